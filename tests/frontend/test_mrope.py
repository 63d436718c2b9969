"""mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with and without DeepStack) against HF
transformers' own forward.

Requests with text-only, image and video prompts (grids of different sizes: different, non-zero
rope deltas) are prefilled together (explicit positions from HF's get_rope_index, vision rows from
HF's vision tower), then verified over three verify/commit rounds with per-request deltas.
Every ragged logit row equals HF's forward over that request's prompt (with its pixels) +
committed + new tokens alone (float32, CPU, reference ops).
"""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.frontend.multimodal import prefill_inputs
from helpers import VL_FAMILIES, tiny_vl

TOL = 1e-5
VOCAB = 64
TEXT_IDS = VOCAB - 5  # text tokens are drawn below the special ids


@pytest.fixture(scope="module", params=VL_FAMILIES)
def compiled(request):
    model = tiny_vl(request.param, vocab=VOCAB)
    return model, dspark_compile(model)


class Request:
    """One request: its prompt (text, or text + one image or video) and what it committed
    since. ``grid`` is ``(t, h, w)``, or ``("video", t, h, w)`` for a video."""

    def __init__(self, model, gen, grid=None, text=(3, 4)):
        cfg, self.model = model.config, model
        before, after = (torch.randint(0, TEXT_IDS, (n,), generator=gen) for n in text)
        self.grid = self.pixels = None
        self.video = grid is not None and grid[0] == "video"
        middle = torch.empty(0, dtype=torch.int64)
        if grid is not None:
            vision = cfg.vision_config
            self.grid = torch.tensor([grid[1:] if self.video else grid])
            n_img = int(self.grid.prod()) // vision.spatial_merge_size ** 2
            token = cfg.video_token_id if self.video else cfg.image_token_id
            middle = torch.cat([torch.tensor([cfg.vision_start_token_id]),
                                torch.full((n_img,), token),
                                torch.tensor([cfg.vision_end_token_id])])
            self.pixels = torch.randn(int(self.grid.prod()), 3 * vision.temporal_patch_size *
                                      vision.patch_size ** 2, generator=gen)
        self.prompt = torch.cat([before, middle, after])
        self.seq = self.prompt.clone()

    def prefill(self):
        """(positions [3, L], delta, vision rows [L, hidden], DeepStack rows [layers, L, hidden]
        or None) of the prompt."""
        layers = min(len(getattr(self.model.config.vision_config, "deepstack_visual_indexes",
                                 ()) or ()), self.model.config.text_config.num_hidden_layers)
        if self.grid is None:
            n = self.prompt.numel()
            return (torch.arange(n).expand(3, n), 0, torch.zeros(n, 64),
                    torch.zeros(layers, n, 64) if layers else None)
        p = prefill_inputs(self.model, self.prompt, **self._media())
        assert (p.deepstack_embeds is None) == (layers == 0)
        return p.positions, p.delta, p.vision_embeds, p.deepstack_embeds

    def _media(self) -> dict:
        if self.video:
            return dict(pixel_values_videos=self.pixels, video_grid_thw=self.grid)
        return dict(pixel_values=self.pixels, image_grid_thw=self.grid)

    def hf_logits(self, tokens):
        """HF's forward over the prompt + committed + ``tokens``: logits of ``tokens``' rows."""
        seq = torch.cat([self.seq, tokens])[None]
        kwargs = {}
        if self.grid is not None:
            cfg = self.model.config
            types = (seq == cfg.image_token_id).int() + 2 * (seq == cfg.video_token_id).int()
            kwargs = dict(self._media(), mm_token_type_ids=types)
        with torch.no_grad():
            return self.model(input_ids=seq, **kwargs).logits[0, -tokens.numel():]


def _check_rows(logits, layout, want):
    qsl = layout.query_start_loc.tolist()
    return max((logits[qsl[i]:qsl[i + 1]] - w).abs().max().item() for i, w in enumerate(want))


def run_session(model, verifier, grids, slots, lens_fn, rounds=3, seed=0, graphs=False):
    """Prefill + ``rounds`` verify/commit rounds; returns (max error, deltas)."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    reqs = [Request(model, gen, g, text=(rng.randint(1, 4), rng.randint(1, 5))) for g in grids]
    state = verifier.new_state(max_requests=max(slots) + 1, max_context=96)
    if graphs:
        verifier.capture(state, block=8, progress=False)
    parts = [r.prefill() for r in reqs]
    deltas = [d for _, d, _, _ in parts]
    layout = VerifyLayout.pack([r.prompt.numel() for r in reqs], [0] * len(reqs), slots,
                               mrope_deltas=deltas,
                               mrope_positions=torch.cat([p for p, _, _, _ in parts], dim=1))
    deepstack = None if parts[0][3] is None else torch.cat([d for *_, d in parts], dim=1)
    logits = verifier(torch.cat([r.prompt for r in reqs]), layout, state,
                      vision_embeds=torch.cat([v for _, _, v, _ in parts]),
                      deepstack_embeds=deepstack)
    err = _check_rows(logits, layout, [_prompt_logits(r) for r in reqs])
    verifier.commit(layout, [r.prompt.numel() for r in reqs], state)
    for _ in range(rounds):
        lens = lens_fn(rng, len(reqs))
        new = [torch.randint(0, TEXT_IDS, (n,), generator=gen) for n in lens]
        layout = VerifyLayout.pack(lens, [r.seq.numel() for r in reqs], slots,
                                   mrope_deltas=deltas)
        logits = verifier(torch.cat(new), layout, state)
        err = max(err, _check_rows(logits, layout, [r.hf_logits(t) for r, t in zip(reqs, new)]))
        accept = [rng.randint(1, n) for n in lens]
        verifier.commit(layout, accept, state)
        for r, t, a in zip(reqs, new, accept):
            r.seq = torch.cat([r.seq, t[:a]])
    return err, deltas


def _prompt_logits(req):
    """HF's logits of the prompt's own rows."""
    saved, req.seq = req.seq, req.seq[:0]
    try:
        return req.hf_logits(req.prompt)
    finally:
        req.seq = saved


SCENARIOS = {
    "text and image prompts, random lengths": (
        [None, (1, 4, 6), (1, 8, 4), None, (1, 4, 4)], [5, 2, 7, 0, 1],
        lambda r, n: [r.randint(1, 8) for _ in range(n)]),
    "N not a multiple of bs": ([(1, 4, 6), None, (1, 8, 4)], [0, 1, 2],
                               lambda r, n: [2, 3, 2]),
    "one image request": ([(1, 8, 4)], [3], lambda r, n: [r.randint(1, 8)]),
    "a video, an image and a text prompt": (
        [("video", 1, 4, 6), (1, 8, 4), None], [1, 4, 0],
        lambda r, n: [r.randint(1, 8) for _ in range(n)]),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_ragged_equals_hf_forward(compiled, scenario):
    model, verifier = compiled
    grids, slots, lens_fn = SCENARIOS[scenario]
    err, deltas = run_session(model, verifier, grids, slots, lens_fn)
    assert err < TOL, f"{scenario}: max |ragged - HF| = {err}"
    image_deltas = [d for g, d in zip(grids, deltas) if g is not None]  # images and videos
    assert all(d != 0 for d in image_deltas), deltas  # the images do shift positions
    if len(image_deltas) > 1:
        assert len(set(image_deltas)) > 1, deltas  # and by a different amount per request


def test_an_image_token_a_draft_proposes_is_embedded_as_hf_does_without_pixels(compiled):
    """A draft may propose the image or video token; with no vision row for it (zeros), it
    keeps its own embedding, as HF's forward does when given no pixels (it was replaced by
    the zero row before)."""
    model, verifier = compiled
    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, TEXT_IDS, (6,), generator=gen)
    draft = torch.tensor([5, cfg.image_token_id, 7, cfg.video_token_id, cfg.image_token_id])
    state = verifier.new_state(max_requests=1, max_context=32)
    verifier(prompt, VerifyLayout.pack([6], [0], [0], mrope_deltas=[0]), state)
    verifier.commit(VerifyLayout.pack([6], [0], [0], mrope_deltas=[0]), [6], state)
    got = verifier(draft, VerifyLayout.pack([5], [6], [0], mrope_deltas=[0]), state)
    with torch.no_grad():
        want = model(input_ids=torch.cat([prompt, draft])[None]).logits[0, -5:]
    assert (got - want).abs().max().item() < TOL


def test_deepstack_maps_past_the_text_layers_are_dropped_as_hf_does():
    """Three DeepStack maps over two text layers: HF adds the first two and never the third;
    the verifier takes two maps a row and prefill_inputs hands it two."""
    model = tiny_vl("qwen3_vl_deepstack3", vocab=VOCAB)
    verifier = dspark_compile(model)
    assert verifier.adapter.mrope.deepstack_layers == 2
    grids, slots, lens_fn = SCENARIOS["text and image prompts, random lengths"]
    err, _ = run_session(model, verifier, grids, slots, lens_fn)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_tier_buffers_carry_the_deltas(compiled):
    """Verify steps through the static tier buffers (padded requests, delta 0) stay exact."""
    model, verifier = compiled
    err, _ = run_session(model, verifier, [(1, 4, 6), None, (1, 8, 4)], [2, 0, 1],
                         lambda r, n: [r.randint(1, 8) for _ in range(n)], graphs=True)
    assert err < TOL, f"max |ragged - HF| through the tier buffers = {err}"


def test_device_positions_equal_host_layout(compiled):
    """A search over query_start_loc on the device gives context + j + delta per row."""
    _, verifier = compiled
    state = verifier.new_state(max_requests=4, max_context=64)
    layout = VerifyLayout.pack([3, 1, 4], [7, 0, 12], [2, 0, 3], mrope_deltas=[-3, 0, 5])
    meta = state.device_metadata(layout.query_start_loc, layout.context_lens, layout.slots,
                                 layout.num_tokens + 2, layout.mrope_deltas)  # 2 padding rows
    rows = meta["mrope_positions"]
    assert rows.shape == (3, 10)
    assert rows[:, :8].tolist() == layout.mrope_rows.tolist()
    assert rows[0, :8].tolist() == [4, 5, 6, 0, 17, 18, 19, 20]
    assert rows[:, 8:].eq(0).all()  # padding rows take delta 0 at position 0


def test_position_math_the_pass_does_not_understand_is_refused(monkeypatch):
    """Positions reduced over their sections before the angles: token-wise, but not what the
    verifier's ``context + j + delta`` rows mean to this code, so flat_mrope refuses it."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf
    from dspark_compile.passes.flat_mrope import MRopeRefused

    rotary = hf.Qwen2VLRotaryEmbedding.forward

    def shifted(self, x, position_ids):
        return rotary(self, x, position_ids - position_ids.amin(0, keepdim=True))

    monkeypatch.setattr(hf.Qwen2VLRotaryEmbedding, "forward", shifted)
    with pytest.raises(MRopeRefused, match=r"reach aten\.(sub|amin) before any rotary angle"
                       ) as err:
        dspark_compile(tiny_vl("qwen2_vl", vocab=VOCAB))
    assert "modeling_qwen2_vl.py" in str(err.value)  # the model source line is named


def test_mrope_inputs_are_checked(compiled):
    model, verifier = compiled
    state = verifier.new_state(max_requests=2, max_context=16)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"mrope_positions .* \[3, 3\]"):
        VerifyLayout.pack([3], [0], [0], mrope_positions=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="mrope_deltas has 2 entries for 1 requests"):
        VerifyLayout.pack([3], [0], [0], mrope_deltas=[1, 2])
    with pytest.raises(ValueError, match=r"vision_embeds is .*\[3, 64\]"):
        verifier(ids, VerifyLayout.pack([3], [0], [0]), state, vision_embeds=torch.zeros(3, 8))
    layout = VerifyLayout.pack([3], [0], [0])
    if verifier.adapter.mrope.deepstack_layers:
        with pytest.raises(ValueError, match=r"deepstack_embeds is .*\[1, 3, 64\]"):
            verifier(ids, layout, state, deepstack_embeds=torch.zeros(1, 2, 64))
    else:
        with pytest.raises(ValueError, match="has no DeepStack layers"):
            verifier(ids, layout, state, deepstack_embeds=torch.zeros(1, 3, 64))


def test_text_model_refuses_mrope_inputs():
    from helpers import tiny_llama

    verifier = dspark_compile(tiny_llama())
    state = verifier.new_state(max_requests=1, max_context=16)
    with pytest.raises(ValueError, match="layout.mrope_deltas was given.*text rotary"):
        verifier(torch.zeros(2, dtype=torch.int64),
                 VerifyLayout.pack([2], [0], [0], mrope_deltas=[3]), state)

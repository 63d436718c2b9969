"""``dspark_compile(model) -> Verifier``: the packed-ragged verify of a model.

    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=R, max_context=C)
    layout = VerifyLayout.pack(lens=[...], context_lens=[...], slots=[...])
    logits = verifier(input_ids, layout, state)      # input_ids int64 [N] -> logits [N, V]
    verifier.commit(layout, accept_lens, state)

The protocol is checked on every call, before anything launches or moves: a refused call raises
a ``ValueError`` (or a subclass: ``ProtocolError``, a call out of order; ``TokenIdError``, an id
outside the vocabulary) or a ``RuntimeError`` subclass (``StaleWeightsError``, the model's
weights replaced or moved since the build; ``HookedModelError``, a forward hook registered on
it since; ``ConcurrentUseError``, a second thread on a captured state), and leaves the state as
it was.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch
from torch import nn

from .config import DSparkConfig
from .frontend.adapters import ModelAdapter, adapter_for
from .frontend.position_tables import position_limit, tightest
from .frontend.capture import CapturedGraph, capture_dense
from .frontend.peft import adapter_layers
from .layout import VerifyLayout
from .graph_inputs import (COMPRESS_KINDS, INDEX_KINDS, KV_KINDS, LINEAR_KINDS, RING_KINDS,
                           WEIGHT_KINDS, WINDOW_KINDS, InputKind)
from .kernels.ops import LOWERED
from .passes import PassContext, PassResult, run_pipeline
from .passes.concat_linear import stack_weights
from .passes.lower import reference_only_ops
from .passes.inductor import compile_rest
from .session import (ConcurrentUseError, HookedModelError, StaleWeightsError, Tier, TierGraphs,
                      VerifySession, WeightBinding, named_tensors, refuse_hooks, tier_set)
from .session.ids import DeviceIdGuard, TokenIdError, check_ids_host
from .session.inputs import check_input_ids, check_mrope_inputs
from .specs import RingSpec
from .state import LinearPools, ProtocolError, VerifierState
from .state.checks import positive_size

__all__ = ["Verifier", "dspark_compile", "ProtocolError", "TokenIdError", "StaleWeightsError",
           "HookedModelError", "ConcurrentUseError"]

log = logging.getLogger("dspark_compile")


def dspark_compile(model: nn.Module, config: DSparkConfig | None = None,
                   **overrides) -> "Verifier":
    """Capture ``model``'s dense verify forward and rewrite it into a packed-ragged one.

    Raises ``RefusedOp`` (a ``RuntimeError``) naming the op and its source line if the model
    mixes tokens in a way no pass can rewrite, ``HookedModelError`` if it runs forward hooks.
    """
    config = (config or DSparkConfig()).with_overrides(**overrides)
    refuse_hooks(model)
    adapter_layers(model)  # PEFT layers whose state cannot be watched: refused before capture
    adapter = adapter_for(model)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None:
        raise TypeError(f"dspark_compile: {type(model).__name__} has no floating-point weights")
    settings = config.resolve(param.device.type)  # every "auto" decided, before any work
    captured = capture_dense(adapter, param.dtype, param.device)
    ctx = PassContext(captured.bs, captured.tokens, list(captured.inputs), settings)
    gm, results = run_pipeline(captured.gm, ctx)
    return Verifier(adapter, gm, ctx.inputs, results, captured, config, param.dtype,
                    param.device, settings.lowering)


OPS = torch.ops.dspark


def _op_summary(gm) -> Counter:
    return Counter(str(getattr(n.target, "overloadpacket", n.target))
                   for n in gm.graph.nodes if n.op == "call_function")


_AXIS = {InputKind.MROPE_POSITIONS.value: 1, InputKind.DEEPSTACK_EMBEDS.value: 1}
"""Inputs whose token axis is not the first."""


def _mark_dynamic(values: dict) -> None:
    """Mark the token and request axes of the packed graph's inputs dynamic before torch.compile
    sees them: the first call then compiles for any N and R, where automatic dynamic shapes
    compile once per axis that changes (three compiles over a tier set instead of one; sizes 0
    and 1 still specialise, so one-request batches compile once more)."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            axis = _AXIS.get(name, 0)
            if value.dim() > axis and value.shape[axis] >= 2:
                torch._dynamo.maybe_mark_dynamic(value, axis)


def _deltas(layout: VerifyLayout) -> torch.Tensor:
    """int32 [R]: the layout's mRoPE deltas (zeros when it carries none)."""
    return layout.mrope_deltas if layout.mrope_deltas is not None else \
        torch.zeros(layout.num_requests, dtype=torch.int32)


class Verifier:
    """A compiled packed-ragged verify forward (see the module docstring)."""

    def __init__(self, adapter: ModelAdapter, gm, inputs, results: list[PassResult],
                 dense: CapturedGraph, config: DSparkConfig, dtype: torch.dtype,
                 device: torch.device, lowering: str = "reference") -> None:
        self.adapter = adapter
        self.graph_module = gm
        self.inputs = inputs
        self.results = results
        self.config = config
        self.dtype = dtype
        self.device = device
        self.lowering = lowering
        self.dense_graph_module = dense.gm
        self._dense_inputs = dense.inputs
        model = adapter.model
        self._weights = named_tensors(model)
        stack_weights(self._weights, inputs)  # concat_linears' stacked inputs, if any
        # the tensors a graph reads: a placeholder no node uses is left unbound, so a buffer
        # the model replaces while the capture never reads it (a table HF grows) stays legal
        bound = [n for graph in (gm, dense.gm)
                 for node in graph.graph.find_nodes(op="placeholder") if node.users
                 for spec in (node.meta["dspark_input"],) if spec.kind in WEIGHT_KINDS
                 for n in (spec.name, *(getattr(spec, "parts", None) or ()))]
        self._binding = WeightBinding(model, self._weights, bound, dense.unread)
        """Every model tensor the graphs bind, checked on each call (``session/weights.py``)."""
        vocab = gm.graph.find_nodes(op="output")[0].args[0].meta["val"].shape[1]
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        self.vocab_size = int(getattr(embed, "num_embeddings", vocab))
        """Token ids must lie in ``0..vocab_size-1``: the rows of the input embedding (the ids
        the model can read; Mllama's are its logits' vocabulary plus 8 image tokens), or the
        logits' vocabulary where the model has no embedding table to ask; fewer where another
        table the ids index directly has fewer rows (``position_tables.token_id_limit``)."""
        id_limit = dense.id_limit
        if id_limit is not None and id_limit[0] < self.vocab_size:
            log.warning("%s: token ids are limited to 0..%d, the rows of %s, which the model "
                        "indexes by the ids as they are (its input embedding has %d)",
                        type(model).__name__, id_limit[0] - 1, id_limit[1], self.vocab_size)
            self.vocab_size = id_limit[0]
        self.position_limit = tightest(position_limit(dense.gm), dense.cache_limit,
                                       self.adapter.rotary_limit)
        """The first position one of the model's position tables cannot serve (learned
        absolute positions), past which its own cache drops keys its forward reads
        (``own_forward.cache_window_limit``), or past which a dynamic rotary rescales
        (``rotary.check_rotaries``): ``new_state`` refuses a longer ``max_context``; None: no
        limit."""
        self.id_check = "host" if device.type == "cpu" else "device"
        """Where out-of-vocabulary ids are caught (``session/ids.py``): ``"host"``, before the
        forward (CPU ids); ``"device"``, clamped and flagged in the forward, refused at commit
        (device ids: no host sync)."""
        self._id_guards: weakref.WeakKeyDictionary[VerifierState, DeviceIdGuard] = \
            weakref.WeakKeyDictionary()
        self._run = compile_rest(gm) if config.inductor else gm
        table = LOWERED.get(lowering, {})
        self._commit_ops = {  # the linear-state commits, in the forward's lowering
            "conv": table.get(OPS.causal_conv1d_commit, OPS.causal_conv1d_commit),
            "gdn": table.get(OPS.gated_delta_rule_commit, OPS.gated_delta_rule_commit),
            "ssd": table.get(OPS.ssd_commit, OPS.ssd_commit)}
        self._states: weakref.WeakSet[VerifierState] = weakref.WeakSet()
        """The states this verifier's ``new_state`` made (their pools fit this model only)."""
        self._sessions: weakref.WeakKeyDictionary[VerifierState, VerifySession] = \
            weakref.WeakKeyDictionary()
        """The session ``capture`` installed per state."""

    # ------------------------------------------------------------------ state
    def new_state(self, max_requests: int, max_context: int, page_size: int | None = None,
                  max_step_tokens: int | None = None,
                  window_rings: bool = False) -> VerifierState:
        """An engine-owned paged KV pool for ``max_requests`` slots of ``max_context`` tokens.

        Hybrid models also get their linear-attention pools and replay rings of
        ``max_step_tokens`` rows (default ``DSparkConfig.max_step_tokens``). With
        ``window_rings``, a plain sliding-window layer keeps only the last ``window +
        max_step_tokens - 1`` positions of each slot (a KV ring, ``state.pools.window_rings``)
        where that is fewer pages than ``max_context``; a request may then put at most
        ``max_step_tokens`` tokens in one step (a longer prompt is prefilled in chunks), and
        ``run_dense`` is refused. Sizes are ints
        >= 1 (None: the config's); anything else is refused. The pools are normal tensors even
        when made under ``torch.inference_mode`` (inference tensors could not be updated by a
        commit or a release outside it).
        """
        page_size = self.config.page_size if page_size is None else page_size
        max_step_tokens = self.config.max_step_tokens if max_step_tokens is None else \
            positive_size("new_state", "max_step_tokens", max_step_tokens)
        limit = self.position_limit
        if limit is not None and isinstance(max_context, int) and \
                not isinstance(max_context, bool) and max_context > limit.positions:
            raise ValueError(
                f"new_state: max_context={max_context} exceeds {limit.reason()}; a context "
                f"must be at most {limit.positions} tokens for this model")
        with torch.inference_mode(False):
            if not isinstance(window_rings, bool):
                raise ValueError(f"new_state: window_rings={window_rings!r}; it must be a bool")
            state = VerifierState.allocate(self.adapter.specs, max_requests, max_context,
                                           page_size, self.dtype, self.device,
                                           max_step_tokens if window_rings else None)
            state.max_step_tokens = max_step_tokens
            if self.adapter.linear_specs:
                state.linear = LinearPools.allocate(
                    self.adapter.linear_specs, self._ring_specs(), max_requests,
                    max_step_tokens, self.dtype, self.device)
        self._states.add(state)
        return state

    def _ring_specs(self) -> list[RingSpec]:
        """Row shape and dtype of each replay ring, read off the packed graph's inputs."""
        out = []
        for node in self.graph_module.graph.find_nodes(op="placeholder"):
            spec = node.meta["dspark_input"]
            if spec.kind in RING_KINDS:
                val = node.meta["val"]
                out.append(RingSpec(spec.name, tuple(int(s) for s in val.shape[1:]), val.dtype))
        return out

    # ------------------------------------------------------------------ verify
    def __call__(self, input_ids: torch.Tensor, layout: VerifyLayout, state: VerifierState,
                 vision_embeds: torch.Tensor | None = None,
                 deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, V]`` of every packed row; writes provisional KV for every row.

        mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take ``vision_embeds [N, hidden]`` for
        a prefill of an image prompt: rows whose token is the image (video) token take that
        row instead of the token embedding (a zero row keeps the token's own) (``frontend.multimodal.prefill_inputs`` makes them
        with HF's vision tower); Qwen3-VL models with DeepStack layers also take
        ``deepstack_embeds [layers, N, hidden]`` (zeros at text rows; None: all zeros). After
        ``capture(state)`` the result is a view of a static buffer, valid until the next call
        on that state; a call with vision or DeepStack rows or explicit
        ``layout.mrope_positions`` (a prefill) runs outside the tier graphs, whose static
        buffers hold none of them.
        """
        check_input_ids(input_ids, self.device)
        self._binding.check()
        self._check_state(state)
        session = self._sessions.get(state)
        owner = session.claim("verify") if session is not None else None
        try:
            state.check_layout(layout, input_ids.numel())
            check_mrope_inputs(self.adapter.mrope, type(self.adapter.model).__name__,
                               self.dtype, layout, vision_embeds, input_ids.numel(),
                               deepstack_embeds)
            if self.id_check == "host":
                check_ids_host(input_ids, layout, self.vocab_size)
        except BaseException:
            if session is not None:
                session.restore(owner)
            raise
        explicit = vision_embeds is not None or deepstack_embeds is not None or \
            layout.mrope_positions is not None
        step = state.steps.begin(layout)
        try:
            if session is not None and not explicit:
                out = session.graphs(input_ids, layout)
            else:
                dev = state.block_table.device
                deltas = None if self.adapter.mrope is None else _deltas(layout).to(dev)
                out = self._packed(input_ids, layout.query_start_loc.to(dev),
                                   layout.context_lens.to(dev), layout.slots.to(dev), state,
                                   deltas, layout.mrope_positions, vision_embeds,
                                   deepstack_embeds)
        except BaseException:
            state.steps.failed(layout)  # a partial overwrite: nothing there is committable
            if session is not None:
                session.restore(owner)
            raise
        state.steps.end(layout, step)
        if self.id_check == "device":
            self._id_guard(state).publish()
        return out

    def _check_state(self, state) -> None:
        if not isinstance(state, VerifierState) or state not in self._states:
            raise ValueError("state was not made by this verifier's new_state; its KV pools "
                             "do not fit this model")

    def _id_guard(self, state: VerifierState) -> DeviceIdGuard:
        guard = self._id_guards.get(state)
        if guard is None:
            guard = self._id_guards[state] = DeviceIdGuard(state.max_requests,
                                                           state.block_table.device)
        return guard

    def _packed(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, slots: torch.Tensor, state: VerifierState,
                mrope_deltas: torch.Tensor | None = None,
                mrope_positions: torch.Tensor | None = None,
                vision_embeds: torch.Tensor | None = None,
                deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The packed forward on device tensors (padded or not); no host sync unless a
        prefill passes explicit mRoPE positions or vision rows."""
        n = input_ids.shape[0]
        values = state.device_metadata(query_start_loc, context_lens, slots, n, mrope_deltas,
                                       triton=self.lowering == "triton")
        if self.id_check == "device":  # clamped in the forward, refused at commit
            input_ids = self._id_guard(state).guard(input_ids, query_start_loc, slots,
                                                    self.vocab_size)
        values["input_ids"] = input_ids
        if self.adapter.mrope is not None:
            if mrope_positions is not None:
                values["mrope_positions"] = mrope_positions.to(input_ids.device)
            spec = self.adapter.mrope
            values["vision_embeds"] = torch.zeros(
                n, spec.hidden_size, dtype=self.dtype, device=input_ids.device
            ) if vision_embeds is None else vision_embeds.to(input_ids.device)
            if spec.deepstack_layers:
                values["deepstack_embeds"] = torch.zeros(
                    spec.deepstack_layers, n, spec.hidden_size, dtype=self.dtype,
                    device=input_ids.device
                ) if deepstack_embeds is None else deepstack_embeds.to(input_ids.device)
        if self.config.inductor:
            _mark_dynamic(values)
        with torch.no_grad():
            return self._run(*self._arguments(self.inputs, values, state))

    def capture(self, state: VerifierState, tiers: tuple[Tier, ...] | None = None,
                block: int | None = None, progress: bool = True, use_graphs: bool | None = None,
                debug: bool = False, commit_graphs: bool = True,
                compile_ahead: bool = True) -> VerifySession:
        """Capture the packed forward per token tier for ``state`` and install the session
        that owns the graphs: later calls on ``state`` (through the verifier or the returned
        session) replay the smallest tier that holds the batch. A second capture of the same
        state replaces the first session.

        ``tiers`` defaults to ``tier_set(state.max_requests, block)``. Without a GPU (or with
        ``use_graphs=False``) nothing is captured but calls still go through the static,
        padded buffers. Models with linear-attention layers also capture their commit, one graph
        per request-slot count (``commit_graphs=False``: commits run eagerly). The Triton
        kernels of every tier compile side by side before the first capture
        (``compile_ahead=False``: each compiles when a capture first launches it). The session's
        ``reports`` hold the time and pool memory each tier took (empty if not captured).
        """
        self._binding.check()
        if not isinstance(state, VerifierState) or state not in self._states:
            raise ValueError("capture: state was not made by this verifier's new_state")
        block = self.config.block if block is None else positive_size("capture", "block", block)
        if tiers is None:
            tiers = tier_set(state.max_requests, block)
        elif not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(f"capture: tiers={tiers!r}; it must be None (tier_set of the state "
                             "and block) or a non-empty sequence of Tier")
        missing = reference_only_ops(self.graph_module)
        if missing and use_graphs is not False and state.block_table.device.type == "cuda":
            raise NotImplementedError(
                f"capture: the packed graph calls {', '.join(missing)}, which have no GPU "
                "kernel yet and run their pure-torch reference (it reads the layout on the "
                "host), so CUDA graphs cannot capture them; pass use_graphs=False to serve the "
                "tiers without graphs")
        if self.id_check == "device":
            self._id_guard(state)  # its flags exist before the graphs capture them
        vocab = self.graph_module.graph.find_nodes(op="output")[0].args[0].meta["val"].shape[1]
        mrope = self.adapter.mrope is not None
        commit = None if state.linear is None or not commit_graphs else (
            lambda qsl, slots, acc: state.linear.replay_accepted(self._commit_ops, qsl, slots,
                                                                 acc))
        graphs = TierGraphs(
            lambda ids, qsl, ctx, slots, deltas: self._packed(
                ids, qsl, ctx, slots, state, deltas if mrope else None),
            tiers, int(vocab), self.dtype, state.block_table.device, use_graphs, debug, commit)
        reports = graphs.capture(progress, compile_ahead) if graphs.use_graphs else []
        session = self._sessions[state] = VerifySession(self, state, graphs, reports)
        return session

    def session(self, state: VerifierState) -> VerifySession | None:
        """The session ``capture`` installed for ``state``, or None."""
        return self._sessions.get(state)

    def drop_session(self, state: VerifierState) -> None:
        """Forget ``state``'s tier graphs (their memory goes when nothing else holds them);
        later calls on ``state`` run the packed forward eagerly."""
        self._sessions.pop(state, None)

    def _arguments(self, specs, values: dict, state: VerifierState) -> list:
        """Graph arguments in placeholder order: weights, pools, then ``values`` by kind."""
        args = []
        for spec in specs:
            if spec.kind in WEIGHT_KINDS:
                args.append(self._weights[spec.name])
            elif spec.kind in KV_KINDS:
                index = int(spec.name.rsplit("_", 1)[1])
                args.append(state.kv_caches[index][0 if spec.kind == InputKind.K_CACHE else 1])
            elif spec.kind in LINEAR_KINDS:
                index = int(spec.name.rsplit("_", 1)[1])
                pools = state.linear.conv_states if spec.kind == InputKind.CONV_STATE else \
                    state.linear.recurrent_states
                args.append(pools[index])
            elif spec.kind in RING_KINDS:
                args.append(state.linear.rings[spec.name])
            elif spec.kind in COMPRESS_KINDS:
                args.append(state.compress_pools[int(spec.name.rsplit("_", 1)[1])])
            elif spec.kind in INDEX_KINDS:
                args.append(state.index_pools[int(spec.name.rsplit("_", 1)[1])])
            elif spec.kind in WINDOW_KINDS:
                args.append(values[spec.name])
            else:
                args.append(values[spec.kind.value])
        return args

    def run_dense(self, input_ids: torch.Tensor, context_lens, slots,
                  state: VerifierState) -> torch.Tensor:
        """The captured dense verify: ``input_ids [bs, T] -> logits [bs, T, V]``.

        Every request runs ``T`` tokens (padding included) at positions ``context_lens[b] + t``
        and writes their KV (linear-attention layers read their slot's state and write
        nothing). This is the graph the passes started from; it is the baseline the
        packed one is compared against, not a path an engine should serve from.
        """
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"run_dense: input_ids has shape {tuple(input_ids.shape)} and "
                             f"dtype {input_ids.dtype}; it must be int64 [bs, T]")
        bs, t = input_ids.shape
        layout = VerifyLayout.pack([t] * bs, context_lens, slots)
        self._binding.check()
        self._check_state(state)
        if state.compact:
            raise ValueError(
                "run_dense: this state keeps some pools in rings or compact entry pools "
                "(window_rings), and the dense graph reads every layer through the full block "
                "table; make its state without window_rings")
        state.check_layout(layout, bs * t)
        positions = layout.positions.view(bs, t) if self.adapter.mrope is None else \
            layout.mrope_rows.reshape(3, bs, t)
        values = {
            "input_ids": input_ids,
            "positions": positions.to(self.device),
            "vision_embeds": torch.zeros(bs, t, getattr(self.adapter.mrope, "hidden_size", 0),
                                         dtype=self.dtype, device=self.device),
            "deepstack_embeds": torch.zeros(
                getattr(self.adapter.mrope, "deepstack_layers", 0), bs, t,
                getattr(self.adapter.mrope, "hidden_size", 0), dtype=self.dtype,
                device=self.device),
            "block_table": state.block_table[layout.slots.long().to(state.block_table.device)],
            "context_lens": layout.context_lens.to(self.device),
            "slots": layout.slots.to(self.device),
        }
        step = state.steps.begin(layout)  # its KV rows overwrite any earlier verify's
        try:
            with torch.no_grad():
                out = self.dense_graph_module(*self._arguments(self._dense_inputs, values,
                                                               state))
        except BaseException:
            state.steps.failed(layout)
            raise
        state.steps.end(layout, step)
        return out

    def commit(self, layout: VerifyLayout, accept_lens, state: VerifierState) -> None:
        """Keep the first ``accept_lens[i]`` tokens of request ``i``; drop the rest.

        ``layout`` must be the layout of the last forward over its slots on this ``state``
        (that forward wrote the provisional rows kept here; a hybrid model's, the state's last
        forward, whose rows the replay rings hold), committed once: anything else raises
        ``ProtocolError`` naming the request and the cause (``state/steps.py``), with nothing
        changed. KV needs bookkeeping only (rejected rows are never read); linear-attention
        layers replay each request's accepted prefix from the replay rings onto its slot. After
        ``capture(state)`` that replay is one CUDA graph per request-slot count (the static,
        padded path on the CPU).
        """
        self._check_state(state)
        session = self._sessions.get(state)
        owner = session.claim("commit") if session is not None else None
        try:
            if self.id_check == "device" and isinstance(layout, VerifyLayout):
                self._id_guard(state).check(layout, self.vocab_size)
            acc = state.advance(layout, accept_lens)
        except BaseException:
            if session is not None:
                session.restore(owner)
            raise
        if state.linear is not None and not (
                session is not None and session.graphs.replay_commit(layout, acc)):
            dev = state.block_table.device
            state.linear.replay_accepted(self._commit_ops, layout.query_start_loc.to(dev),
                                layout.slots.to(dev), acc.to(dev))
        if session is not None:
            session.done()

    # ------------------------------------------------------------------ report
    def explain(self) -> str:
        """What each pass did, with the model source lines it rewrote, and the graph summary."""
        lines = [f"dspark_compile: {type(self.adapter.model).__name__} ({self.adapter.kind} "
                 f"model, {len(self.adapter.specs)} cached-attention layers)"]
        for spec in self.adapter.specs:
            traits = [f"window {spec.window}" if spec.window else
                      f"chunks of {spec.chunk}" if spec.chunk else "causal"]
            traits += [f"softcap {spec.softcap}"] * bool(spec.softcap) + ["sinks"] * spec.sinks
            traits += [f"relative logits over {spec.relative} distances"] * bool(spec.relative)
            traits += ["ALiBi"] * spec.alibi
            c = spec.compress
            if c is not None:
                traits.append(f"compressed every {c.rate} tokens" +
                              (" with overlap" if c.overlap else "") +
                              (f", indexer top-{c.index_topk} ({c.index_heads} heads x "
                               f"{c.index_head_dim})" if c.index_topk else ""))
            if spec.sparse:
                x = spec.index
                traits.append("sparse: an earlier layer's picks" if x is None else
                              f"sparse: indexer top-{x.topk} ({x.heads} heads x {x.head_dim})"
                              if not x.block else
                              f"block-sparse: top-{x.topk} blocks of {x.block} per indexer head "
                              f"({x.local} local; {x.heads} heads x {x.head_dim})")
            dims = str(spec.head_dim) if spec.v_head_dim is None else \
                f"{spec.head_dim} (q/k) / {spec.v_head_dim} (v)"
            lines.append(f"  attention {spec.name}: {', '.join(traits)}; "
                         f"{spec.num_kv_heads} kv heads x {dims}" +
                         (", K=V (one pool)" if spec.shared_kv else "") +
                         (f", the K/V pools of {self.adapter.specs[spec.kv_from].name}"
                          if spec.kv_from is not None else ""))
        for r in self.results:
            details = ", ".join(f"{k}={v}" for k, v in sorted(r.details.items()))
            lines.append(f"  pass {r.name}: {r.changed} rewritten" +
                         (f" ({details})" if details else ""))
            for what, where in r.rewrites:
                lines.append(f"      {what}  <- {where}")
        before, after = _op_summary(self.dense_graph_module), _op_summary(self.graph_module)
        lines.append("  graph ops (dense -> packed):")
        for op in sorted(set(before) | set(after)):
            if before[op] != after[op]:
                lines.append(f"      {op}: {before[op]} -> {after[op]}")
        lines.append("  packed inputs: " + ", ".join(
            s.name for s in self.inputs if s.kind not in WEIGHT_KINDS))
        return "\n".join(lines)

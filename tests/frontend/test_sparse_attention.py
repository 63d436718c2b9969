"""DeepSeek Sparse Attention (DeepSeek-V3.2 and the models transformers derives from it):
ragged verify against HF's own forward, what the capture reads off the layers, and the
refusals that keep anything else out."""

from __future__ import annotations

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.zoo import check, select
from dspark_compile.zoo.check import TOLERANCE

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("sparse_attention")


def _entry(name):
    (entry,) = [e for e in select([name]) if e.name == name]
    return entry


@pytest.mark.parametrize("name,feature", [
    ("deepseek_v32", "half-split indexer rotary on the first channels, MLA"),
    ("glm_moe_dsa", "interleaved indexer rotary; the second layer reuses the first's picks"),
    ("hy_v4", "indexer rotary on the last channels, scale in the weights, sinks, shared picks"),
])
def test_dsa_models_verify_exact_with_the_indexer_selecting(name, feature):
    result = check(_entry(name))
    assert result.status == "exact", (feature, result.status, result.reason, result.where)
    assert result.max_error <= TOLERANCE and not result.tie_rows, (feature, result.reason)


def _tiny(name):
    from dspark_compile.zoo.tiny import tiny_config

    entry = _entry(name)
    model_cls = getattr(transformers, entry.architecture)
    tiny = tiny_config(entry.model_type, model_cls)
    torch.manual_seed(0)
    return model_cls(tiny.config).eval()


def test_the_spec_names_each_layers_indexer_and_the_layer_that_reuses_picks():
    verifier = dspark_compile(_tiny("glm_moe_dsa"))
    first, second = verifier.adapter.specs
    assert first.sparse and first.index is not None and first.index.topk == 3
    assert second.sparse and second.index is None  # "shared": the first layer's picks
    text = verifier.explain()
    assert "sparse: indexer top-3" in text and "sparse: an earlier layer's picks" in text
    packed = [str(n.target) for n in verifier.graph_module.graph.nodes if n.op == "call_function"]
    assert packed.count("dspark.sparse_index.default") == 1
    assert packed.count("dspark.sparse_attention.default") == 2


def test_an_indexer_with_its_forward_replaced_is_refused_by_name():
    model = _tiny("deepseek_v32")
    indexer = model.model.layers[0].self_attn.indexer
    indexer.forward = type(indexer).forward.__get__(indexer)
    with pytest.raises(NotImplementedError, match="replaced on the instance"):
        dspark_compile(model)


def test_an_unknown_indexer_class_is_refused_by_name():
    model = _tiny("deepseek_v32")
    attn = model.model.layers[0].self_attn

    class MyIndexer(type(attn.indexer)):
        pass

    attn.indexer.__class__ = MyIndexer
    with pytest.raises(NotImplementedError, match="MyIndexer"):
        dspark_compile(model)


def test_an_indexer_whose_module_helper_changed_is_refused(monkeypatch):
    """The replacement re-implements the rotary the forward calls: under the very same forward
    source, a module whose apply_rotary_pos_emb computes otherwise (HY-V4-VL's is interleaved
    and float32) is not the indexer it was derived from."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

    model = _tiny("deepseek_v32")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # a helper of another source
        return q, k

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    with pytest.raises(NotImplementedError, match=r"DeepseekV32Indexer .*the functions its "
                       r"forward calls in .*modeling_deepseek_v32 \(\{'apply_rotary_pos_emb'"):
        dspark_compile(model)


def test_hy_v4_vl_whose_indexer_forward_is_hy_v4s_is_refused():
    """HY-V4-VL's indexer forward has HY-V4's source; its rotary does not."""
    if "hy_v4_vl" not in transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        pytest.skip("this transformers has no HY-V4-VL")
    from dspark_compile.zoo.check import Entry

    result = check(Entry("hy_v4_vl", "HYV4VLForConditionalGeneration"))
    assert result.status == "refused" and "HYV4VLIndexer" in result.reason


def test_indices_from_an_unknown_attention_class_are_refused():
    model = _tiny("deepseek_v32")
    attn = model.model.layers[0].self_attn

    class MyAttention(type(attn)):
        pass

    attn.__class__ = MyAttention
    with pytest.raises(NotImplementedError, match="not a known sparse attention layer"):
        dspark_compile(model)


def test_a_proven_mask_gives_the_indexer_its_rows_and_nothing_else():
    from dspark_compile.frontend.masks import WindowMask
    from dspark_compile.frontend.sparse import IndexerMask

    mask = WindowMask(0)
    assert mask[:, 0, :, :] == IndexerMask(0, 0) and mask[:, 0] == IndexerMask(0, 0)
    for key in ((slice(None), slice(None), slice(-1, None), slice(None)), 0,
                (slice(None), 1)):
        with pytest.raises(NotImplementedError, match="indexes its attention mask"):
            mask[key]


def test_an_indexer_takes_only_the_plain_causal_mask():
    from dspark_compile.frontend.sparse import IndexerMask, _arguments

    x = torch.zeros(1, 2, 4)
    with pytest.raises(NotImplementedError, match="window 4"):
        _arguments("idx", (x, x, (x, x), IndexerMask(4, 0), None), {})
    with pytest.raises(NotImplementedError, match="a NoneType"):
        _arguments("idx", (x, x, (x, x), None, None), {})
    with pytest.raises(NotImplementedError, match="with a cache"):
        _arguments("idx", (x, x, (x, x), IndexerMask(), None), {"cache": object()})

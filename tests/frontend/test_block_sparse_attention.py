"""MiniMax-M3's block-sparse layers: ragged verify against HF's own forward (its eager path's
block mask), what the capture reads off the layers, and the refusals that keep anything else
out."""

from __future__ import annotations

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.zoo import check, select
from dspark_compile.zoo.check import TOLERANCE, Entry

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxM3VLForCausalLM"):
    pytest.skip("this transformers has no MiniMax-M3", allow_module_level=True)

pytestmark = pytest.mark.xdist_group("block_sparse_attention")
NAME = "minimax_m3_vl_text"


def _entry(variant="", overrides=()):
    (base,) = [e for e in select([NAME]) if e.name == NAME]
    return Entry(base.model_type, base.architecture, variant, overrides)


@pytest.mark.parametrize("variant,overrides", [
    ("", ()),  # 4 indexer heads over 2 KV heads: a pick row per query head
    ("index_heads_kv", (("index_n_heads", 2),)),  # MiniMax-M3's own: a row per KV head
    ("mqa", (("num_key_value_heads", 1),)),
    ("heads6_kv3_index2", (("hidden_size", 96), ("num_attention_heads", 6),
                           ("num_key_value_heads", 3), ("index_n_heads", 2))),
    ("blocks3_top3_local2", (("index_block_size", 3), ("index_topk_blocks", 3),
                             ("index_local_blocks", 2))),
    ("no_local", (("index_local_blocks", 0),)),
])
def test_block_sparse_layers_verify_exact(variant, overrides):
    result = check(_entry(variant, overrides))
    assert result.status == "exact", (variant, result.status, result.reason, result.where)
    assert result.max_error <= TOLERANCE and not result.tie_rows, (variant, result.reason)


def _tiny():
    from dspark_compile.zoo.tiny import tiny_config

    model_cls = transformers.MiniMaxM3VLForCausalLM
    tiny = tiny_config(NAME, model_cls)
    torch.manual_seed(0)
    return model_cls(tiny.config).eval()


def test_the_spec_and_graph_name_the_block_indexer():
    verifier = dspark_compile(_tiny())
    full, sparse = verifier.adapter.specs
    assert not full.sparse and full.index is None
    assert sparse.sparse and sparse.index is not None
    assert (sparse.index.block, sparse.index.topk, sparse.index.local) == (4, 2, 1)
    assert "block-sparse: top-2 blocks of 4 per indexer head (1 local" in verifier.explain()
    calls = [n for n in verifier.graph_module.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls].count("dspark.block_index.default") == 1
    (attention,) = [n for n in calls if str(n.target) == "dspark.sparse_attention.default"]
    assert attention.args[-1] == 4, "the attention reads each pick as a block of 4 keys"
    indexer = verifier.adapter.model.model.layers[1].self_attn.indexer
    assert "forward" not in indexer.__dict__ and "build_block_mask" not in indexer.__dict__


def test_position_ids_other_than_the_captures_are_refused(monkeypatch):
    """A decoder layer that hands its attention other positions (here equal values, but a new
    tensor) is refused: the block ops number keys by the block table."""
    model = _tiny()
    layer_cls = type(model.model.layers[1])
    original = layer_cls.forward

    def shifted(self, *args, position_ids=None, **kwargs):
        return original(self, *args, position_ids=position_ids + 0, **kwargs)

    monkeypatch.setattr(layer_cls, "forward", shifted)
    with pytest.raises(NotImplementedError, match="position_ids are not the positions"):
        dspark_compile(model)


def test_the_eager_block_mask_is_refused_inside_a_capture():
    from dspark_compile.frontend.sparse import indexer_hooks

    model = _tiny()
    indexer = model.model.layers[1].self_attn.indexer
    names = {id(m): n for n, m in model.named_modules()}
    with indexer_hooks(model, names):
        with pytest.raises(NotImplementedError, match="build_block_mask"):
            indexer.build_block_mask(None, None, 8, torch.float32, "cpu", None)
    assert "build_block_mask" not in indexer.__dict__


def test_block_indices_from_an_unknown_attention_class_are_refused():
    model = _tiny()
    attn = model.model.layers[1].self_attn

    class MyAttention(type(attn)):
        pass

    attn.__class__ = MyAttention
    with pytest.raises(NotImplementedError, match="block_indices= .*not a known sparse"):
        dspark_compile(model)

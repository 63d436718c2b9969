"""The compressed-attention kernels (DeepSeek-V4's HCA / CSA: ``kernels/compress.py``,
``index_topk.py``, ``compressed_attention.py``), the sparse-attention ones (DeepSeek-V3.2's
DSA: ``kernels/sparse.py``) and the row store both use (``kernels/rows.py``) compile ahead of
time for cuda:90, hip:gfx942 and gfx950.

Same harness as ``test_aot_compile.py``: the compile runs in a subprocess without the
interpreter (this file run as a script, printing one JSON line). Shapes are DeepSeek-V4-Flash's:
head dim 512 with a 64-channel rotary, 64 query heads, CSA windows of 4 (8 slots with overlap),
HCA windows of 128 (slot blocks of 16), an indexer of 64 heads x 128, in bf16 with float32
position biases and norm weights. DSA's: HF's eager MLA attention (128 heads, each its own K/V
head, Dk 192, Dv 128) in bf16, and a GQA build with sinks in float32 (the ``ieee`` dots).
MiniMax-M3's block-sparse layers: 64 heads over 4 KV heads with a pick row each, blocks of 128
keys, and its block indexer's maxima (4 heads x 128) in bf16.
"""

from __future__ import annotations

import json
import os

from aot import TARGET_NAMES, aot_tests, compile_kernel

_LAYOUT = {"qsl_ptr": "i32", "seq_lens_ptr": "i32", "table_ptr": "i32"}
_ENTRIES = {"kv_pool_ptr": "bf16", "gate_pool_ptr": "bf16", "entry_pool_ptr": "bf16",
            "fresh_ptr": "bf16", "bias_ptr": "fp32", "weight_ptr": "fp32",
            "inv_freq_ptr": "fp32", "raw_table_ptr": "i32", **_LAYOUT}

_ATTENTION = {"out_ptr": "bf16", "q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
              "k_cache_ptr": "bf16", "v_cache_ptr": "bf16", "query_start_loc_ptr": "i32",
              "seq_lens_ptr": "i32", "block_table_ptr": "i32", "slot_mapping_ptr": "i64",
              "sinks_ptr": "fp32", "entries_ptr": "bf16", "topk_ptr": "i64",
              "entry_table_ptr": "i32"}
_ATTENTION_SHAPE = {"GROUP": 64, "BLOCK_H": 16, "NUM_HB": 4, "HEAD_DIM": 512,
                    "HEAD_DIM_PAD": 512, "PAGE_SIZE": 64, "ENTRY_PAGE_SIZE": 64, "TILE_N": 16,
                    "TILE_E": 16, "SEARCH": 32, "DOT_PRECISION": "ieee", "HAS_WINDOW": True,
                    "HAS_SINKS": True}

def _sparse_pointers(dtype: str) -> dict:
    """Pointer dtypes of ``kernels/sparse.py``'s attention kernel with q, pools and out in
    ``dtype``."""
    return {"out_ptr": dtype, "q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype,
            "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32", "block_table_ptr": "i32",
            "picks_ptr": "i64", "sinks_ptr": "fp32"}


_SPARSE_SHAPE = {"BLOCK_H": 16, "PAGE_SIZE": 64, "CHUNK": 128, "UPCAST": False,
                 "DOT_PRECISION": "ieee"}

# case -> (module, kernel attribute, pointer dtypes by argument, constexprs, float scalars)
CASES = {
    "entries_csa_bf16": ("compress", "_entries", _ENTRIES,
                         {"OVERLAP": True, "PAIRS": 256, "ROPE_PAIRS": 32, "SLOT_BLOCK": 8,
                          "NUM_SLOTS": 8, "CHUNK": 128},
                         {"eps": "fp32", "rope_scale": "fp32"}),
    "entries_hca_bf16": ("compress", "_entries", _ENTRIES,
                         {"OVERLAP": False, "PAIRS": 256, "ROPE_PAIRS": 32, "SLOT_BLOCK": 16,
                          "NUM_SLOTS": 128, "CHUNK": 128},
                         {"eps": "fp32", "rope_scale": "fp32"}),
    "index_scores_bf16": ("index_topk", "_scores",
                          {"q_ptr": "bf16", "w_ptr": "fp32", "entry_ptr": "bf16",
                           "out_ptr": "i64", **_LAYOUT},
                          {"H_PAD": 64, "D_PAD": 128, "BLOCK_E": 16, "CHUNK": 128},
                          {"softmax_scale": "fp32"}),
    "attention_csa_bf16": ("compressed_attention", "_compressed_attention_kernel", _ATTENTION,
                           {**_ATTENTION_SHAPE, "RATE": 4, "UPCAST": False, "HAS_TOPK": True},
                           {"scale_log2": "fp32"}),
    "attention_hca_bf16": ("compressed_attention", "_compressed_attention_kernel", _ATTENTION,
                           {**_ATTENTION_SHAPE, "RATE": 128, "UPCAST": False, "HAS_TOPK": False},
                           {"scale_log2": "fp32"}),
    "store_rows_bf16": ("rows", "_store_rows_kernel",
                        {"a_src_ptr": "bf16", "a_dst_ptr": "bf16", "b_src_ptr": "bf16",
                         "b_dst_ptr": "bf16", "slot_mapping_ptr": "i64"},
                        {"BLOCK_W": 1024, "TWO": True}, {}),
    "sparse_attention_mla_bf16": ("sparse", "_sparse_attention_kernel", _sparse_pointers("bf16"),
                                  {**_SPARSE_SHAPE, "GROUP": 1, "NUM_HEADS": 128,
                                   "NUM_KV_HEADS": 128, "UNIT": 1, "SPAN": 128,
                                   "PICK_ROWS": 1, "PICK_BLOCK": 1, "NUM_HB": 1,
                                   "HEAD_DIM": 192,
                                   "HEAD_DIM_PAD": 256, "HEAD_DIM_V": 128,
                                   "HEAD_DIM_V_PAD": 128, "TILE_P": 16, "HAS_SINKS": False},
                                  {"scale_log2": "fp32"}),
    "sparse_attention_gqa_sinks_fp32": ("sparse", "_sparse_attention_kernel",
                                        _sparse_pointers("fp32"),
                                        {**_SPARSE_SHAPE, "GROUP": 8, "NUM_HEADS": 32,
                                         "NUM_KV_HEADS": 4, "UNIT": 8, "SPAN": 32,
                                         "PICK_ROWS": 1, "PICK_BLOCK": 1, "NUM_HB": 1,
                                         "HEAD_DIM": 128,
                                         "HEAD_DIM_PAD": 128, "HEAD_DIM_V": 128,
                                         "HEAD_DIM_V_PAD": 128, "TILE_P": 32,
                                         "HAS_SINKS": True},
                                        {"scale_log2": "fp32"}),
    "block_sparse_attention_bf16": ("sparse", "_sparse_attention_kernel",
                                    _sparse_pointers("bf16"),
                                    {**_SPARSE_SHAPE, "GROUP": 16, "NUM_HEADS": 64,
                                     "NUM_KV_HEADS": 4, "UNIT": 16, "SPAN": 16, "PICK_ROWS": 4,
                                     "PICK_BLOCK": 128, "NUM_HB": 1, "HEAD_DIM": 128,
                                     "HEAD_DIM_PAD": 128, "HEAD_DIM_V": 128,
                                     "HEAD_DIM_V_PAD": 128, "TILE_P": 32, "HAS_SINKS": False},
                                    {"scale_log2": "fp32"}),
    "block_scores_bf16": ("sparse", "_block_scores",
                          {"q_ptr": "bf16", "key_ptr": "bf16", "out_ptr": "fp32", **_LAYOUT},
                          {"PAGE_SIZE": 64, "BLOCK": 128, "LOCAL": 1, "H_PAD": 16,
                           "D_PAD": 128, "TILE_K": 64, "CHUNK": 128}, {}),
}


def _compile_all() -> dict:
    """Compile every case for every target; return ``{case: {target: [artifact kinds]}}``."""
    import importlib

    result: dict = {}
    for case, (module, attr, pointers, constexprs, scalars) in CASES.items():
        kernel = getattr(importlib.import_module(f"dspark_compile.kernels.{module}"), attr)
        missing = (set(pointers) | set(constexprs) | set(scalars)) - set(kernel.arg_names)
        assert not missing, f"{case}: {attr} has no arguments {sorted(missing)}"
        for name in TARGET_NAMES:
            result.setdefault(case, {})[name] = compile_kernel(
                kernel, pointers, constexprs, name, {"num_warps": 8}, scalars=scalars)
    return result


compiled, test_compressed_kernel_compiles_ahead_of_time = aot_tests(__file__, CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))

"""The ``*_triton`` twins of the ``dspark::`` ops (CUDA and ROCm; same schema as the
reference op plus launch choices) and ``LOWERED``, the table the lowering pass swaps by.

Kernel modules are imported inside the op bodies: importing them needs a GPU driver (or
TRITON_INTERPRET=1 set before the import), and registering the ops must not.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.attention_reference import check_alibi, check_rel, check_semantics
from ..ops.compressed_reference import (check_compress, check_entries, check_index,
                                        check_raw_layout)
from ..ops import experts as _experts
from ..ops.sparse_reference import check_block_index, check_picks, check_sparse_index
from ..ops.linear import skinny_linear_fake as _skinny_fake  # also registers the reference ops
from .launch import zeros_when_warming

__all__ = ["LOWERED"]


@torch.library.custom_op("dspark::ragged_attention_triton",
                         mutates_args=("k_cache", "v_cache"), device_types=("cuda",))
def ragged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor,
                            scale: float, max_query_len: int,
                            early_reads: bool = False, window: int = 0, softcap: float = 0.0,
                            sinks: Optional[torch.Tensor] = None,
                            chunk: int = 0, rel: Optional[torch.Tensor] = None,
                            alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dspark::ragged_attention`` lowered to Triton (CUDA and ROCm devices).

    ``max_query_len`` sizes the query tile (the verify block); results are exact for any
    value, a longer request (a prefill) just spans more tiles. ``early_reads``: the launch
    before this one writes none of the metadata nor the pools' committed rows, so they may be
    read before the PDL wait (``select.early_attention_reads`` decides it from the graph).
    ``window``, ``softcap``, ``sinks``, ``chunk``, ``rel``, ``alibi``: the reference op's switches
    (keywords after the launch choices: ``lower`` appends those to the reference call's ten
    leading arguments).
    """
    from .attention import ragged_attention_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(
        q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
        window=window, softcap=softcap, sinks=sinks, chunk=chunk, rel=rel, alibi=alibi,
        max_query_len=max_query_len, early_reads=early_reads))


@ragged_attention_triton.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      max_query_len, early_reads=False, window=0, softcap=0.0, sinks=None, chunk=0, rel=None,
      alibi=None):
    check_semantics("ragged_attention_triton", window, softcap, sinks, q.shape[1],
                    chunk=chunk, row_sinks=tuple(q.shape[:2]))
    check_rel("ragged_attention_triton", rel, tuple(q.shape[:2]), softcap)
    check_alibi("ragged_attention_triton", alibi, q.shape[1], softcap)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::linear_group_triton", mutates_args=(), device_types=("cuda",))
def linear_group_triton(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``dspark::linear_group`` lowered to Triton (one launch per group at small M)."""
    from .linear import linear_group_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, weights))


@linear_group_triton.register_fake
def _(x, weights):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


@torch.library.custom_op("dspark::rotary_apply_triton", mutates_args=(), device_types=("cuda",))
def rotary_apply_triton(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> list[torch.Tensor]:
    """``dspark::rotary_apply`` lowered to Triton (q and k in one launch)."""
    from .rotary import rotary_apply_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, y, cos, sin))


@rotary_apply_triton.register_fake
def _(x, y, cos, sin):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(y.shape, dtype=y.dtype, device=y.device)]


@torch.library.custom_op("dspark::skinny_linear_triton", mutates_args=(),
                         device_types=("cuda",))
def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], eps: float, glu: bool,
                         residual: Optional[torch.Tensor],
                         glu_out: bool, cos: Optional[torch.Tensor] = None,
                         sin: Optional[torch.Tensor] = None,
                         rot_cols: int = 0,
                         weight_settled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``dspark::skinny_linear`` lowered to Triton (one launch at a verify step's few rows).
    ``weight_settled``: no launch of the graph writes ``w`` (``select.settled_weight``), so its
    first tile may be read before the PDL wait."""
    from .skinny import skinny_linear_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, w, bias, gamma, eps, glu, residual, glu_out, cos=cos,
                                     sin=sin, rot_cols=rot_cols, weight_settled=weight_settled))


def _skinny_triton_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos=None, sin=None,
                        rot_cols=0, weight_settled=False):
    return _skinny_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos, sin, rot_cols)


skinny_linear_triton.register_fake(_skinny_triton_fake)


@torch.library.custom_op("dspark::causal_conv1d_triton", mutates_args=("ring",),
                         device_types=("cuda",))
def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, ring: torch.Tensor,
                         activation: str) -> torch.Tensor:
    """``dspark::causal_conv1d`` lowered to Triton."""
    from .conv import causal_conv1d_triton as kernel

    return zeros_when_warming(kernel(x, weight, bias, conv_state, query_start_loc, slots, ring,
                                     activation))


@causal_conv1d_triton.register_fake
def _(x, weight, bias, conv_state, query_start_loc, slots, ring, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dspark::causal_conv1d_commit_triton", mutates_args=("conv_state",),
                         device_types=("cuda",))
def causal_conv1d_commit_triton(conv_state: torch.Tensor, ring: torch.Tensor,
                                query_start_loc: torch.Tensor, slots: torch.Tensor,
                                accept_lens: torch.Tensor) -> None:
    """``dspark::causal_conv1d_commit`` lowered to Triton."""
    from .conv import causal_conv1d_commit_triton as kernel

    kernel(conv_state, ring, query_start_loc, slots, accept_lens)


@causal_conv1d_commit_triton.register_fake
def _(conv_state, ring, query_start_loc, slots, accept_lens):
    return None


@torch.library.custom_op("dspark::gated_delta_rule_triton",
                         mutates_args=("ring_k", "ring_v", "ring_g", "ring_beta"),
                         device_types=("cuda",))
def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, recurrent_state: torch.Tensor,
                            query_start_loc: torch.Tensor, slots: torch.Tensor,
                            ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
                            ring_beta: torch.Tensor, scale: float,
                            use_qk_l2norm: bool) -> torch.Tensor:
    """``dspark::gated_delta_rule`` lowered to Triton."""
    from .gdn import gated_delta_rule_triton as kernel

    return zeros_when_warming(kernel(q, k, v, g, beta, recurrent_state, query_start_loc, slots,
                                     ring_k, ring_v, ring_g, ring_beta, scale, use_qk_l2norm))


@gated_delta_rule_triton.register_fake
def _(q, k, v, g, beta, recurrent_state, query_start_loc, slots, ring_k, ring_v, ring_g,
      ring_beta, scale, use_qk_l2norm):
    return q.new_empty(v.shape[0], v.shape[1], v.shape[2])


@torch.library.custom_op("dspark::gated_delta_rule_commit_triton",
                         mutates_args=("recurrent_state",), device_types=("cuda",))
def gated_delta_rule_commit_triton(recurrent_state: torch.Tensor, ring_k: torch.Tensor,
                                   ring_v: torch.Tensor, ring_g: torch.Tensor,
                                   ring_beta: torch.Tensor, query_start_loc: torch.Tensor,
                                   slots: torch.Tensor, accept_lens: torch.Tensor) -> None:
    """``dspark::gated_delta_rule_commit`` lowered to Triton."""
    from .gdn import gated_delta_rule_commit_triton as kernel

    kernel(recurrent_state, ring_k, ring_v, ring_g, ring_beta, query_start_loc, slots,
           accept_lens)


@gated_delta_rule_commit_triton.register_fake
def _(recurrent_state, ring_k, ring_v, ring_g, ring_beta, query_start_loc, slots, accept_lens):
    return None


@torch.library.custom_op("dspark::ssd_triton", mutates_args=("ring_x", "ring_b", "ring_da"),
                         device_types=("cuda",))
def ssd_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
               ssm_state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
               ring_x: torch.Tensor, ring_b: torch.Tensor, ring_da: torch.Tensor,
               dt_softplus: bool, dt_min: float, dt_max: float) -> torch.Tensor:
    """``dspark::ssd`` (Mamba-2 scan) lowered to Triton."""
    from .ssd import ssd_triton as kernel

    return zeros_when_warming(kernel(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc,
                                     slots, ring_x, ring_b, ring_da, dt_softplus, dt_min,
                                     dt_max))


@ssd_triton.register_fake
def _(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots, ring_x, ring_b, ring_da,
      dt_softplus, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dspark::ssd_commit_triton", mutates_args=("ssm_state",),
                         device_types=("cuda",))
def ssd_commit_triton(ssm_state: torch.Tensor, ring_x: torch.Tensor, ring_b: torch.Tensor,
                      ring_da: torch.Tensor, query_start_loc: torch.Tensor,
                      slots: torch.Tensor, accept_lens: torch.Tensor) -> None:
    """``dspark::ssd_commit`` lowered to Triton."""
    from .ssd import ssd_commit_triton as kernel

    kernel(ssm_state, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens)


@ssd_commit_triton.register_fake
def _(ssm_state, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens):
    return None


@torch.library.custom_op("dspark::experts_route_triton", mutates_args=(),
                         device_types=("cuda",))
def experts_route_triton(ids: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dspark::experts_route`` lowered to Triton (a stable counting sort, two launches)."""
    from .experts import experts_route_triton as kernel

    return zeros_when_warming(kernel(ids, query_start_loc, num_experts))


experts_route_triton.register_fake(_experts.route_fake)


@torch.library.custom_op("dspark::experts_up_triton", mutates_args=(), device_types=("cuda",))
def experts_up_triton(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                      w: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool,
                      activation: str) -> torch.Tensor:
    """``dspark::experts_up`` lowered to Triton's grouped GEMM with the gate in its epilogue
    (or ``torch._grouped_mm`` where ``TargetConfig.experts_kernel`` says so)."""
    from .experts import experts_up_triton as kernel

    return zeros_when_warming(kernel(x, order, offsets, w, bias, transposed, activation))


experts_up_triton.register_fake(_experts.up_fake)


@torch.library.custom_op("dspark::experts_down_triton", mutates_args=(),
                         device_types=("cuda",))
def experts_down_triton(h: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                        weights: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                        transposed: bool) -> torch.Tensor:
    """``dspark::experts_down`` lowered to Triton: grouped GEMM with the routing weights, then
    the combine in ``k`` order (or ``torch._grouped_mm`` per ``TargetConfig.experts_kernel``)."""
    from .experts import experts_down_triton as kernel

    return zeros_when_warming(kernel(h, order, offsets, weights, w, bias, transposed))


experts_down_triton.register_fake(_experts.down_fake)


@torch.library.custom_op("dspark::compress_triton",
                         mutates_args=("kv_pool", "gate_pool", "entry_pool"),
                         device_types=("cuda",))
def compress_triton(kv: torch.Tensor, gate: torch.Tensor, kv_pool: torch.Tensor,
                    gate_pool: torch.Tensor, entry_pool: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, slot_mapping: torch.Tensor,
                    position_bias: torch.Tensor, norm_weight: torch.Tensor,
                    inv_freq: torch.Tensor, rate: int, overlap: bool, eps: float,
                    rope_scale: float, raw_block_table: Optional[torch.Tensor] = None,
                    raw_slot_mapping: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dspark::compress`` lowered to Triton: the raw-row write, then one program per row
    making the entry of the window it closes (``kernels/compress.py``)."""
    from .compress import compress_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc,
                                     seq_lens, block_table, slot_mapping, position_bias,
                                     norm_weight, inv_freq, rate, overlap, eps, rope_scale,
                                     raw_block_table, raw_slot_mapping))


@compress_triton.register_fake
def _(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc, seq_lens, block_table,
      slot_mapping, position_bias, norm_weight, inv_freq, rate, overlap, eps, rope_scale,
      raw_block_table=None, raw_slot_mapping=None):
    check_compress("compress_triton", kv, gate, kv_pool, gate_pool, entry_pool,
                   position_bias, norm_weight, inv_freq, rate, overlap, 2)
    check_raw_layout("compress_triton", block_table, slot_mapping, raw_block_table,
                     raw_slot_mapping)
    return kv.new_empty(kv.shape[0], entry_pool.shape[-1])


@torch.library.custom_op("dspark::compressed_attention_triton",
                         mutates_args=("k_cache", "v_cache"), device_types=("cuda",))
def compressed_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                scale: float, window: int, softcap: float,
                                sinks: Optional[torch.Tensor], entries: torch.Tensor,
                                fresh: torch.Tensor, rate: int,
                                topk: Optional[torch.Tensor] = None,
                                entry_block_table: Optional[torch.Tensor] = None
                                ) -> torch.Tensor:
    """``dspark::compressed_attention`` lowered to Triton: one launch, a program per query row
    and block of 16 heads, the K/V write fused (``kernels/compressed_attention.py``)."""
    from .compressed_attention import compressed_attention_triton as kernel  # needs a GPU

    return zeros_when_warming(kernel(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                     block_table, slot_mapping, scale, window, softcap, sinks,
                                     entries, fresh, rate, topk,
                                     entry_block_table=entry_block_table))


@compressed_attention_triton.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      window, softcap, sinks, entries, fresh, rate, topk=None, entry_block_table=None):
    check_semantics("compressed_attention_triton", window, softcap, sinks, q.shape[1])
    check_entries("compressed_attention_triton", q, entries, fresh, rate, topk, 1)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::index_topk_triton", mutates_args=(), device_types=("cuda",))
def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
                      fresh: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, rate: int, topk: int,
                      softmax_scale: float) -> torch.Tensor:
    """``dspark::index_topk`` on the GPU: Triton scores, then ``torch.topk`` on the device
    (``kernels/index_topk.py``; equal scores go to the lower entry index)."""
    from .index_topk import index_topk_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(q, weights, entry_pool, fresh, query_start_loc, seq_lens,
                                     block_table, rate, topk, softmax_scale))


@index_topk_triton.register_fake
def _(q, weights, entry_pool, fresh, query_start_loc, seq_lens, block_table, rate, topk,
      softmax_scale):
    check_index("index_topk_triton", q, weights, entry_pool, fresh, rate, topk, 1)
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::sparse_attention_triton",
                         mutates_args=("k_cache", "v_cache"), device_types=("cuda",))
def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                            picks: torch.Tensor, sinks: Optional[torch.Tensor] = None,
                            pick_block: int = 1) -> torch.Tensor:
    """``dspark::sparse_attention`` lowered to Triton: the K/V write, then a program per query
    row and block of 16 heads over its picks (``kernels/sparse.py``)."""
    from .sparse import sparse_attention_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                     block_table, slot_mapping, scale, picks, sinks,
                                     pick_block))


@sparse_attention_triton.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      picks, sinks=None, pick_block=1):
    check_picks("sparse_attention_triton", q.shape, picks, pick_block)
    check_semantics("sparse_attention_triton", 0, 0.0, sinks, q.shape[1])
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::block_index_triton", mutates_args=("key_pool",),
                         device_types=("cuda",))
def block_index_triton(q: torch.Tensor, k: torch.Tensor, key_pool: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                       topk: int, local: int) -> torch.Tensor:
    """``dspark::block_index`` lowered to Triton: the key write, then the per-head block
    maxima and ``torch.topk`` (``kernels/sparse.py``)."""
    from .sparse import block_index_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(q, k, key_pool, query_start_loc, seq_lens, block_table,
                                     slot_mapping, block_size, topk, local))


@block_index_triton.register_fake
def _(q, k, key_pool, query_start_loc, seq_lens, block_table, slot_mapping, block_size, topk,
      local):
    check_block_index("block_index_triton", q, k, key_pool, block_size, topk, local, 1)
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::sparse_index_triton", mutates_args=("key_pool",),
                         device_types=("cuda",))
def sparse_index_triton(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                        key_pool: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor,
                        slot_mapping: torch.Tensor, topk: int,
                        softmax_scale: float) -> torch.Tensor:
    """``dspark::sparse_index`` lowered to Triton: the key write, then the indexer of
    ``kernels/index_topk.py`` at rate 1 (``kernels/sparse.py``)."""
    from .sparse import sparse_index_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(q, weights, k, key_pool, query_start_loc, seq_lens,
                                     block_table, slot_mapping, topk, softmax_scale))


@sparse_index_triton.register_fake
def _(q, weights, k, key_pool, query_start_loc, seq_lens, block_table, slot_mapping, topk,
      softmax_scale):
    check_sparse_index("sparse_index_triton", q, weights, k, key_pool, topk, 1)
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


LOWERED = {"triton": {
    torch.ops.dspark.compress: torch.ops.dspark.compress_triton,
    torch.ops.dspark.index_topk: torch.ops.dspark.index_topk_triton,
    torch.ops.dspark.compressed_attention: torch.ops.dspark.compressed_attention_triton,
    torch.ops.dspark.sparse_index: torch.ops.dspark.sparse_index_triton,
    torch.ops.dspark.sparse_attention: torch.ops.dspark.sparse_attention_triton,
    torch.ops.dspark.block_index: torch.ops.dspark.block_index_triton,
    torch.ops.dspark.ragged_attention: torch.ops.dspark.ragged_attention_triton,
    torch.ops.dspark.linear_group: torch.ops.dspark.linear_group_triton,
    torch.ops.dspark.rotary_apply: torch.ops.dspark.rotary_apply_triton,
    torch.ops.dspark.skinny_linear: torch.ops.dspark.skinny_linear_triton,
    torch.ops.dspark.causal_conv1d: torch.ops.dspark.causal_conv1d_triton,
    torch.ops.dspark.causal_conv1d_commit: torch.ops.dspark.causal_conv1d_commit_triton,
    torch.ops.dspark.gated_delta_rule: torch.ops.dspark.gated_delta_rule_triton,
    torch.ops.dspark.gated_delta_rule_commit:
        torch.ops.dspark.gated_delta_rule_commit_triton,
    torch.ops.dspark.ssd: torch.ops.dspark.ssd_triton,
    torch.ops.dspark.ssd_commit: torch.ops.dspark.ssd_commit_triton,
    torch.ops.dspark.experts_route: torch.ops.dspark.experts_route_triton,
    torch.ops.dspark.experts_up: torch.ops.dspark.experts_up_triton,
    torch.ops.dspark.experts_down: torch.ops.dspark.experts_down_triton,
}}
"""Per lowering: reference op packet -> the op that implements it there."""

"""Per-target choices of the Triton lowering: the one place where CUDA and ROCm differ.

One Triton source serves every target; what differs (warp size, dot precision for float32
operands, tile sizes, pipeline depth, warps per program) sits in :data:`TARGETS`, one frozen
:class:`TargetConfig` per target. :func:`target_for_device` picks the entry for a torch device
and :func:`gpu_target` gives the ``triton.backends.compiler.GPUTarget`` that ahead-of-time
compilation (``triton.compile``) takes, so CI can build every kernel for every target on a
machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TargetConfig", "TARGETS", "SKINNY_MAX_ROWS", "INTERPRETER_TARGET",
           "target_for_device", "gpu_target"]


SKINNY_MAX_ROWS = 64
"""Rows of the skinny kernel's largest row tile: ``TargetConfig.skinny_max_m`` may not pass it.
Row tiles past it were built and measured (commit 132b9d1, ``skinny_mid_sweep.json``): at 192
rows every fused launch lost to the input launch + ``torch.mm``."""


@dataclass(frozen=True)
class TargetConfig:
    """Launch and tiling choices of one GPU target."""

    name: str
    """Key in :data:`TARGETS`: ``sm_80``, ``sm_90``, ``gfx942``, ``gfx950``."""
    backend: str
    """Triton backend: ``cuda`` or ``hip``."""
    arch: int | str
    """Architecture as ``GPUTarget`` spells it: compute capability ``90`` or ``"gfx942"``."""
    warp_size: int
    """Threads per warp (wavefront): 32 on NVIDIA, 64 on CDNA3/CDNA4."""
    fp32_dot_precision: str
    """``input_precision`` of ``tl.dot`` on float32 operands. AMD has no TF32 (``ieee``)."""
    attn_tile_n: int
    """Keys per iteration of the attention loop (a multiple of the page size is not needed)."""
    attn_max_block_m: int
    """Most (query token x query head) rows in one program's tile (long prefills)."""
    attn_num_warps: int
    """Warps per attention program of 16 or 32 rows (64 rows: twice as many)."""
    attn_num_stages: int
    """Software-pipeline depth of the attention loop's K/V loads."""
    attn_max_registers: int | None
    """Registers per thread of 16-row programs (``maxnreg``, NVIDIA only; None: no cap)."""
    reduce_num_warps: int
    """Warps per program of the split-KV reduction."""
    split_min_keys: int
    """Fewest keys one split of the context may get: below it a split costs more than it saves."""
    split_max: int
    """Most splits of one request's context."""
    split_waves: int
    """Programs to aim for, per multiprocessor, when the batch alone does not fill the GPU."""
    default_sm_count: int
    """Multiprocessors assumed when the device cannot be asked (the interpreter)."""
    attn_fold_reduce: bool = True
    """Split launches merge their partials in the attention kernel (the last program of a
    q-block to finish, found with an atomic counter) instead of a second reduce launch.
    Untested on ROCm: the AMD entries keep the reduce launch."""
    search_chunk: int = 1024
    """``query_start_loc`` entries a program loads at once to find its request (4 KB)."""
    linear_max_m: int = 64
    """Most rows (packed tokens) the grouped skinny matmul takes; more go to ``torch.mm``."""
    linear_max_group_elems: int = 16 * 2**20
    """Largest group (sum of N_i x K) the skinny matmul takes (q+k+v of the 1.1B model: 8M)."""
    linear_block_n: int = 64
    """Weight rows (output columns) per program of the skinny matmul."""
    linear_block_k: int = 128
    """K per iteration of the skinny matmul."""
    linear_num_warps: int = 4
    linear_num_stages: int = 4
    linear_min_split_k: int = 256
    """Fewest K one split of the skinny matmul may get."""
    linear_waves: int = 2
    """Programs per multiprocessor the skinny matmul's column tiles must reach before K is
    left whole (fewer: split K)."""
    # skinny_*: H200, bf16, the 1.1B model's weights, CUDA-graph replay over weight copies that
    # miss L2 (`benchmarks/skinny_kernel.py`, skinny_kernel.json; the tile sweep in
    # skinny_kernel_sweep.json), us at M = 3 / 24 / 64, torch.mm -> this kernel:
    #   o 2048x2048      6.0 / 6.2 / 6.2  ->  5.4 / 5.8 / 6.8
    #   q+k+v 4096x2048  7.0 / 7.1 / 7.1  ->  7.0 / 7.2 / 9.2
    #   gate+up 16384x2048  18.2 / 18.7 / 19.4  ->  17.9 / 19.4 / 21.3
    #   down 2048x8192  13.9 / 13.8 / 14.3  ->  11.1 / 11.6 / 13.0
    #   LM head 32000x2048  34.7 / 35.5 / 37.2  ->  32.7 / 35.7 / 39.5
    # With the prologues (same file, "fused"): q+k+v with residual add + RMSNorm 9.2 / 9.9 /
    # 15.1; gate+up with both and the SiLU-and-mul epilogue 20.7 / 22.4 / 39.7; down with the
    # SiLU-and-mul prologue 23.8 / 22.2 / 33.9 (so fuse_linears puts that one in gate+up's
    # epilogue instead). At 64 rows the unfused launches win: the whole step at bs 8 with full
    # blocks (64 rows) took 1.73 ms fused against 1.39 unfused (verify_step_fuse_ab.json,
    # all8), while 24 rows gained (1.29 against 1.33). Hence 32.
    # Those kernel figures were captured on a stream other than the warm-up's, so launches the
    # plan splits (o, down, q+k+v, down with the prologue) ran unsplit; with the split, at 3 / 24
    # rows (skinny_split_sweep.json): o 4.7 / 5.1, down 10.3 / 10.9, q+k+v with the residual
    # add + norm 8.5 / 9.5, gate+up with the SiLU epilogue 20.1 / 21.9. The down prologue was
    # not re-timed.
    skinny_max_m: int = 32
    """Most rows (packed tokens) ``dspark::skinny_linear`` gives its skinny Triton kernel; more
    take the input launch and ``torch.mm`` (``kernels/skinny.py``). At most
    :data:`SKINNY_MAX_ROWS` (refused at construction)."""
    skinny_block_n: int = 64
    """Weight rows (output columns) per program of the skinny kernel."""
    skinny_block_k: int = 128
    """K per iteration of the skinny kernel."""
    skinny_num_warps: int = 4
    skinny_num_stages: int = 5
    skinny_min_programs: int = 128
    """Column tiles x K splits the skinny kernel aims for: about one per multiprocessor."""
    skinny_min_split_k: int = 512
    """Fewest K one split of the skinny kernel may get."""
    skinny_rms_block_k: int = 256
    """K per iteration of an unsplit skinny launch with the RMSNorm prologue (the LM head): the
    prologue's work per iteration is paid over twice the bytes. H200, 32000x2048 with residual
    add + norm: 34.4 us against 37.2 at M=3, 41.1 against 42.0 at M=24 (skinny_kernel.json,
    fused); gate+up without the SiLU epilogue 18.6 against 19.8. Plain and split launches
    measured slower with it (skinny_kernel_sweep.json)."""
    skinny_rms_num_stages: int = 3
    """Pipeline depth with ``skinny_rms_block_k`` (the measured configuration)."""
    skinny_rope_min_m: int = 1
    """Fewest rows at which the q/k/v launch rotates q and k in its epilogue (``rot_cols``);
    fewer rows take the plain kernel and the rotary kernel in place after it. H200, whole step
    at bs 1 (3 rows): with the attention's early reads (``attn_early_reads``) the epilogue won,
    0.9674 ms against 0.9996 with the rotary launch (one session, ``verify_step.py --quick``
    with ``--target skinny_rope_min_m=1`` against 16); before them it lost by 3 to 12 us over
    three sessions (once won by 7), while at 24 rows it always won by 38 to 61 us."""
    skinny_max_smem: int = 210 * 1024
    """Shared memory the skinny kernel's pipeline may take (its stages are cut to fit)."""
    skinny_swap: bool = False
    """The skinny kernel's dot takes the activation tile as its first operand (``a @ w.T``
    tiles; the first operand may stay in registers) instead of the weight tile."""
    skinny_tma: bool = False
    """Load weight tiles through a tensor descriptor (TMA on sm_90) instead of pointers."""
    pdl: bool = False
    """Launch the lowering's kernels with programmatic dependent launch (``kernels/pdl.py``):
    each may start while the one before it finishes. sm_90 and newer, CUDA only."""
    skinny_early_w_max_m: int = 16
    """Most rows at which a skinny launch whose weight the graph shows settled
    (``select.settled_weight``) loads its first weight tile(s) before its PDL wait (0: never).
    H200, whole step, one session, with the option as it was then (every settled launch, no
    row threshold: ``verify_step.py --quick --target skinny_early_w=true`` against
    without): bs 1 (3 rows) 0.9247 against 0.9673 ms, bs 8 (24 rows) 1.1523 against 1.1408.
    Today's A/B: ``--target skinny_early_w_max_m=0`` against the default."""
    mid_split_k: int = 1
    """K chunks of a matmul past ``skinny_max_m`` rows (up to ``mid_split_max_m``) whose K is at
    least ``mid_split_min_ratio`` times its N (the MLP's down projection): one batched cuBLAS
    GEMM over ``mid_split_k`` strided K chunks writes fp32 partials, and one Triton launch sums
    them in chunk order (``triton_skinny._split_mm``). 1: off, a plain ``torch.mm``.
    H200, down (2048 x 8192) with its SiLU-and-mul input launch, us at 64 / 96 / 192 / 384 /
    768 rows for 1 / 2 / 4 / 8 chunks (``benchmarks/splitk_bmm.py --op``, splitk_bmm_op.json):
    17.9 / 17.7 / 18.0 / 19.3; 19.0 / 19.5 / 18.6 / 20.6; 27.3 / 23.5 / 21.5 / 25.3;
    36.2 / 29.9 / 31.2 / 37.5; 49.0 / 50.3 / 55.7 / 71.7. Whole step at bs 64 (192 rows),
    one session at aea1538: 2.2554 ms against 2.3545 with ``--target mid_split_k=1``
    (verify_step_quick_bs64_aea1538.json, verify_step_quick_mid_split_k_1_bs64_aea1538.json)."""
    mid_split_full_m: int = 192
    """Rows up to which ``mid_split_k`` chunks are taken whole (halved per doubling past it)."""
    mid_split_max_m: int = 384
    mid_split_min_ratio: int = 4
    attn_early_reads: bool = True
    """With ``pdl``: an attention launch the graph shows safe (``select.early_attention_reads``)
    reads its request bounds, block-table row and first K/V tile before its PDL wait. H200,
    whole step (``verify_step.py --quick`` against ``--target attn_early_reads=false``, one
    session): bs 1 0.9973 against 1.0267 ms, bs 8 1.1342 against 1.1511."""

    def __post_init__(self) -> None:
        if self.skinny_max_m > SKINNY_MAX_ROWS:
            raise ValueError(f"TargetConfig.skinny_max_m={self.skinny_max_m}; the skinny "
                             f"kernel's largest row tile holds {SKINNY_MAX_ROWS} rows, so it "
                             f"must be at most {SKINNY_MAX_ROWS}")


# H200 (sm_90), bf16, 16/8 heads, head 128, page 16, context 1024, verify width 8, CUDA-graph
# replay, triton 3.6, us at bs 64 / 256 (KV floor at 4.8 TB/s: 56.4 / 225.4), from
# `benchmarks/attention_kernel.py --sweep` runs of the build before the final one (the final
# table, 72.1 / 273.4, is in benchmarks/results/attention_kernel.json):
#   tile 64, 4 warps, 2 stages, maxnreg 128   71.7 / 271  (the choice before the small-batch
#     sweep below; 38 KB smem and 128 registers keep 4 programs/SM)
#   same without the register cap             91.9 / 296  (155 registers: 3 programs/SM)
#   tile 32, 4 warps, 3 stages, maxnreg 128   70.1 / 267  (one run; within 2%)
#   tile 64, 4 warps, 3 stages (uncapped)     89.6 / 289;  tile 128, 8 warps, 3 stages 96 / 370
# Splits at bs 1 / 8: 8 splits 11.9 us / 5-8 splits 19.1-20.2 us, against 22.7 / 28.1 unsplit
# and 15.2 / 37.4 at 32 splits (so >= 128 keys per split); bs 64 in 2 splits: 81.9 vs 71.6.
# Small batches, mean-3 mix (`attention_kernel.py --small-sweep`, attention_small_sweep.json),
# us at bs 1 / 8 with the rule's 8 / 5 splits, merge in a reduce launch -> folded:
#   tile 64, 2 stages   12.1 -> 12.1 / 20.8 -> 19.8
#   tile 64, 3 stages   11.7 ->  9.4 / 20.0 -> 18.6
#   tile 32, 3 stages   11.5 ->  9.2 / 19.4 -> 17.6  <- chosen (sm_90), with the fold
# (16 splits: 9.3 / 21.6 folded). At bs 64 / 256 tile 32 with 3 stages ran 70.1 / 267 us
# against 71.7 / 271 for tile 64 with 2 stages (above).
# Those graph figures were captured on a stream other than the warm-up's, where a split launch
# has no counters and merges in a reduce launch; captured on the warm-up's stream (as the tier
# graphs are), with PDL, tile 32, 3 stages, folded (attention_small_sweep.json): bs 1 8.99 us
# at 8 splits, 8.78 at 16; bs 8 17.49 at 5, 16.41 at 8. Hence the split count is rounded up to
# a power of two (plan_attention): 8 at bs 1 and 8.
# 16 splits at bs 8 (64-key splits: --target split_waves=4 --target split_min_keys=64) lost
# to the rule's 8: whole step 1.2130 / 1.2137 ms against 1.1296 / 1.1363 in two A/B pairs of
# one session (verify_step.py --quick --bs 8; verify_step_quick_*bs8.json holds the first).
# Programs in KV-head-major order (the KV heads of a q-block adjacent; commit 008b358, since
# removed): whole step bs 64 / 256 2.3500 / 7.2216 ms against 2.3507 / 7.2922 in one session
# (verify_step_quick_*bs64_256.json), within noise.
# 4 stages instead of 3 (tile 32): whole step bs 64 2.3819 ms against 2.3419 in one session
# at 5bc0c5d (verify_step.py --quick --bs 64 --target attn_num_stages=4,
# verify_step_quick_attn_num_stages_4_bs64.json against verify_step_quick_bs64.json).
# At b287f27 the table's choice (tile 32, 4 warps, 3 stages, cap 128) was still the fastest at
# bs 64 / 256, mean-3 mix: 70.5 / 268.6 us, against 79.1 / 298.5 for tile 64 with 8 warps and
# 3 stages, 80.1 / 304.5 for tile 128 with 8 warps and 2 stages, 86.6 / 280.9 for tile 64 with
# 4 warps, 3 stages and the cap, 107.0 / 331.9 for tile 32 with 8 warps (attention_tiles.json,
# `attention_kernel.py --tiles ...`). A plain kernel that only reads the same pages in the same
# order with tile 32 / 4 warps / 3 stages takes 72.5 us at bs 64 (`hbm_read.py --paged`,
# hbm_read_paged.json), so the attention's arithmetic is hidden behind its reads; that read
# pattern with tile 64 and 8 warps takes 66.3 us, a contiguous read of the same bytes 61.6, and
# a head-major pool ([pages, Hkv, page, D]) reads no faster than this one (72.3 / 66.1 us).
# The context loop alone (both dots, no softmax, tile 32) takes 66.3 us; with one page a step
# through tensor descriptors (TMA) 83.3 us at 3 or 4 stages, 66.8 at 6, 110.4 on 8 warps
# (same file, "dots"), so TMA page loads are no lead here.
# The sm_80 and AMD entries are untuned starting points (no A100 or MI300 was available):
# 2 stages is what the AMD stream pipeliner is built around, and 4 wavefronts of 64 lanes
# give 256 threads a program.
TARGETS: dict[str, TargetConfig] = {
    "sm_80": TargetConfig(
        name="sm_80", backend="cuda", arch=80, warp_size=32, fp32_dot_precision="tf32",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=128,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=108,
    ),
    "sm_90": TargetConfig(
        name="sm_90", backend="cuda", arch=90, warp_size=32, fp32_dot_precision="tf32",
        attn_tile_n=32, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=3,
        attn_max_registers=128,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=132, pdl=True, mid_split_k=4,
    ),
    "gfx942": TargetConfig(
        name="gfx942", backend="hip", arch="gfx942", warp_size=64, fp32_dot_precision="ieee",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=None,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=304, attn_fold_reduce=False,
    ),
    "gfx950": TargetConfig(
        name="gfx950", backend="hip", arch="gfx950", warp_size=64, fp32_dot_precision="ieee",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=None,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=256, attn_fold_reduce=False,
    ),
}
"""Every supported target, by name."""

INTERPRETER_TARGET = "sm_90"
"""Entry used for CPU tensors (``TRITON_INTERPRET=1``): the tests run the H200's tile shapes."""


def target_for_device(device: torch.device | str) -> TargetConfig:
    """The :data:`TARGETS` entry for a torch device.

    CPU tensors (the Triton interpreter) get :data:`INTERPRETER_TARGET`; CUDA devices of compute
    capability 9.0 or newer get ``sm_90`` and 8.x ``sm_80``; ROCm devices are looked up by their
    ``gcnArchName``. Anything else raises ``ValueError``.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return TARGETS[INTERPRETER_TARGET]
    if device.type != "cuda":
        raise ValueError(
            f"target_for_device: device {device} is neither 'cuda' (CUDA or ROCm) nor 'cpu' "
            "(the Triton interpreter); move the tensors to one of those"
        )
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = props.gcnArchName.split(":")[0]
        if arch not in TARGETS:
            supported = [n for n, t in TARGETS.items() if t.backend == "hip"]
            raise ValueError(
                f"target_for_device: ROCm architecture {arch!r} has no entry; supported: "
                f"{supported}. Add a TargetConfig to dspark_compile/kernels/targets.py"
            )
        return TARGETS[arch]
    if props.major >= 9:
        return TARGETS["sm_90"]
    if props.major == 8:
        return TARGETS["sm_80"]
    raise ValueError(
        f"target_for_device: compute capability {props.major}.{props.minor} is below 8.0; "
        "the kernels need sm_80 or newer (bf16 tensor cores)"
    )


def gpu_target(name: str):
    """``triton.backends.compiler.GPUTarget`` of a :data:`TARGETS` entry, for ``triton.compile``."""
    from triton.backends.compiler import GPUTarget  # kept local: importing triton is not free

    if name not in TARGETS:
        raise ValueError(f"gpu_target: unknown target {name!r}; known: {sorted(TARGETS)}")
    cfg = TARGETS[name]
    return GPUTarget(cfg.backend, cfg.arch, cfg.warp_size)

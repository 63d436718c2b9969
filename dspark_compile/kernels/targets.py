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
Chosen by ``python benchmarks/skinny_kernel.py --mid-sweep``; figures in docs/tuning.md."""


@dataclass(frozen=True)
class TargetConfig:
    """Launch and tiling choices of one GPU target."""

    @property
    def has_tma(self) -> bool:
        """The target has the tensor memory accelerator (NVIDIA sm_90 and newer): a kernel may
        take a tensor descriptor's loads (what it chooses is its own tuning)."""
        return self.backend == "cuda" and isinstance(self.arch, int) and self.arch >= 90

    name: str
    """Key in :data:`TARGETS`: ``sm_80``, ``sm_90``, ``gfx942``, ``gfx950``."""
    backend: str
    """Triton backend: ``cuda`` or ``hip``."""
    arch: int | str
    """Architecture as ``GPUTarget`` spells it: compute capability ``90`` or ``"gfx942"``."""
    warp_size: int
    """Threads per warp (wavefront): 32 on NVIDIA, 64 on CDNA3/CDNA4."""
    fp32_dot_precision: str
    """``input_precision`` of ``tl.dot`` on float32 operands where torch allows TF32 matmuls
    (``device.fp32_dot_precision``; IEEE otherwise). AMD has no TF32 (``ieee``)."""
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
    attn_max_smem: int = 160 * 1024
    """Shared memory (bytes, as ``plan_attention`` estimates it) an attention program's K/V
    pipeline and Q tile may take at head dims past 128; its stages, then its key tile, are cut
    to fit. 160 KB leaves headroom under the H200's 227 KB for what the estimate omits."""
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
    # skinny_*: chosen by `python benchmarks/skinny_kernel.py` (and `--sweep`); figures in
    # docs/tuning.md.
    skinny_max_m: int = 32
    """Most rows (packed tokens) ``dspark::skinny_linear`` gives its skinny Triton kernel; more
    take the input launch and ``torch.mm`` (``kernels/skinny.py``). At most
    :data:`SKINNY_MAX_ROWS` (refused at construction). Chosen by
    ``python benchmarks/verify_step.py --fuse-linears on|off``; figures in docs/tuning.md."""
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
    prologue's work per iteration is paid over twice the bytes. Chosen by
    ``python benchmarks/skinny_kernel.py``; figures in docs/tuning.md."""
    skinny_rms_num_stages: int = 3
    """Pipeline depth with ``skinny_rms_block_k`` (the measured configuration)."""
    skinny_rope_min_m: int = 1
    """Fewest rows at which the q/k/v launch rotates q and k in its epilogue (``rot_cols``);
    fewer rows take the plain kernel and the rotary kernel in place after it. Chosen by
    ``python benchmarks/verify_step.py --quick --target skinny_rope_min_m=N``; figures in
    docs/tuning.md."""
    skinny_max_smem: int = 210 * 1024
    """Shared memory the skinny kernel's pipeline may take, counted as stages x (weight + row
    tile) (its K tile and stages are cut to fit, and never past ``max_shared``). gfx950's is
    below its LDS: its builds hold about 5 KB past that count."""
    max_shared: int = 227 * 1024
    """Shared memory (LDS on AMD) one program may take at most: the opt-in 227 KB of sm_90,
    163 KB of sm_80, 64 / 160 KB of gfx942 / gfx950; a launch that asks for more fails. The
    skinny kernel's early weight tile is kept only where its extra buffer fits under it
    (``plan_skinny``)."""
    skinny_swap: bool = False
    """The skinny kernel's dot takes the activation tile as its first operand (``a @ w.T``
    tiles; the first operand may stay in registers) instead of the weight tile."""
    skinny_tma: bool = False
    """Load weight tiles through a tensor descriptor (TMA on sm_90) instead of pointers."""
    pdl: bool = False
    """Launch the lowering's kernels with programmatic dependent launch (``kernels/pdl.py``):
    each may start while the one before it finishes. sm_90 and newer, CUDA only. Chosen by
    ``python benchmarks/verify_step.py --quick --target pdl=false``; figures in docs/tuning.md."""
    skinny_early_w_max_m: int = 16
    """Most rows at which a skinny launch whose weight the graph shows settled
    (``passes/lower.py``'s ``settled_weight``) loads its first weight tile(s) before its PDL
    wait (0: never). Chosen by ``python benchmarks/verify_step.py --quick --target
    skinny_early_w_max_m=0`` against the default; figures in docs/tuning.md."""
    mid_split_k: int = 1
    """K chunks of a matmul past ``skinny_max_m`` rows (up to ``mid_split_max_m``) whose K is at
    least ``mid_split_min_ratio`` times its N (the MLP's down projection): one batched cuBLAS
    GEMM over ``mid_split_k`` strided K chunks writes fp32 partials, and one Triton launch sums
    them in chunk order (``kernels/skinny.py``'s ``_split_mm``). 1: off, a plain ``torch.mm``.
    Chosen by ``python benchmarks/splitk_bmm.py --op``; figures in docs/tuning.md."""
    mid_split_full_m: int = 192
    """Rows up to which ``mid_split_k`` chunks are taken whole (halved per doubling past it)."""
    mid_split_max_m: int = 384
    mid_split_min_ratio: int = 4
    attn_early_reads: bool = True
    """With ``pdl``: an attention launch the graph shows safe (``passes/lower.py``'s
    ``early_attention_reads``) reads its request bounds, block-table row and first K/V tile
    before its PDL wait. Chosen by ``python benchmarks/verify_step.py --quick --target
    attn_early_reads=false``; figures in docs/tuning.md."""

    experts_kernel: str = "triton"
    """The grouped GEMMs of ``dspark::experts_up`` / ``experts_down``: ``"triton"``
    (``kernels/experts.py``) or ``"grouped_mm"`` (the vendor ``torch._grouped_mm`` on rows
    gathered into expert order; bf16 with 16-byte row strides only, anything else takes Triton).
    Chosen by ``python benchmarks/moe_layer.py``, which times both; figures in
    docs/benchmarks.md."""
    experts_block_n: int = 64
    """Output columns per program of the experts' grouped up GEMM (untuned)."""
    experts_down_block_n: int = 64
    """Output columns per program of the experts' grouped down GEMM (K is the expert width,
    short: wider tiles re-read each row tile's activations fewer times)."""
    experts_down_block_n_wide: int = 128
    """The same where row tiles hold 64 pairs (the plan's ``BLOCK_M`` 64: at 128 experts from
    about bs 128, mean 3): a row tile's activations are re-read ``N / BLOCK_N`` times, as many
    bytes as its expert's weights when ``BLOCK_N == BLOCK_M``. Chosen by ``python
    benchmarks/moe_layer.py --tiles``; figures in docs/benchmarks.md."""
    experts_cache_hints: bool = True
    """L2 eviction hints in the experts' kernels: weights ``evict_first`` (each is read once, and
    a layer's stream of them would push out what is read again), the GEMMs' rows and results
    ``evict_last`` (a row tile's rows are read by every column tile, the up GEMM's result by the
    down GEMM, the down GEMM's by the combine), the combine's reads ``evict_first``. Chosen by
    ``python benchmarks/moe_layer.py --target experts_cache_hints=false``; figures in
    docs/benchmarks.md."""
    experts_tma: bool = False
    """Load the experts GEMMs' weight tiles through a tensor descriptor (TMA on sm_90) where
    the weights allow it (``kernels/experts.py``, ``_tma_weights``). On for sm_90, chosen by
    ``python benchmarks/moe_layer.py [--sustained] --target experts_tma=true`` against the
    default; figures in docs/tuning.md."""
    experts_block_k: int = 64
    """K per iteration of the experts' grouped GEMM (untuned)."""
    experts_num_warps: int = 4
    experts_num_stages: int = 3

    def __post_init__(self) -> None:
        if self.experts_kernel not in ("triton", "grouped_mm"):
            raise ValueError(f"TargetConfig.experts_kernel={self.experts_kernel!r}; it must be "
                             "'triton' or 'grouped_mm'")
        if self.skinny_max_m > SKINNY_MAX_ROWS:
            raise ValueError(f"TargetConfig.skinny_max_m={self.skinny_max_m}; the skinny "
                             f"kernel's largest row tile holds {SKINNY_MAX_ROWS} rows, so it "
                             f"must be at most {SKINNY_MAX_ROWS}")


# Attention tiles and stages (sm_90): chosen by `python benchmarks/attention_kernel.py --sweep`.
# Attention splits: chosen by `python benchmarks/attention_kernel.py --small-sweep`.
# Figures for both in docs/tuning.md. The sm_80 and AMD entries are untuned starting points:
# 2 stages is what the AMD stream pipeliner is built around, and 4 wavefronts of 64 lanes
# give 256 threads a program.
TARGETS: dict[str, TargetConfig] = {
    "sm_80": TargetConfig(
        name="sm_80", backend="cuda", arch=80, warp_size=32, fp32_dot_precision="tf32",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=128,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=108, max_shared=163 * 1024,
    ),
    "sm_90": TargetConfig(
        name="sm_90", backend="cuda", arch=90, warp_size=32, fp32_dot_precision="tf32",
        attn_tile_n=32, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=3,
        attn_max_registers=128,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=132, pdl=True, mid_split_k=4, experts_tma=True,
    ),
    "gfx942": TargetConfig(
        name="gfx942", backend="hip", arch="gfx942", warp_size=64, fp32_dot_precision="ieee",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=None,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=304, attn_fold_reduce=False, max_shared=64 * 1024,
    ),
    "gfx950": TargetConfig(
        name="gfx950", backend="hip", arch="gfx950", warp_size=64, fp32_dot_precision="ieee",
        attn_tile_n=64, attn_max_block_m=64, attn_num_warps=4, attn_num_stages=2,
        attn_max_registers=None,
        reduce_num_warps=4, split_min_keys=128, split_max=16, split_waves=2,
        default_sm_count=256, attn_fold_reduce=False, max_shared=160 * 1024,
        skinny_max_smem=152 * 1024,
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

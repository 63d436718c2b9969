"""Configuration of a compiled verifier (frozen: build a new one to change it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

__all__ = ["DSparkConfig", "ResolvedConfig"]

log = logging.getLogger("dspark_compile")

GROUP_LINEARS = ("auto", "concat", "triton", "off")
"""The values of ``DSparkConfig.group_linears``."""
ROTARY = ("auto", "inductor", "triton")
"""The values of ``DSparkConfig.rotary``."""
FUSE_LINEARS = ("auto", "on", "off")
"""The values of ``DSparkConfig.fuse_linears``."""
ROTARY_EPILOGUE = ("auto", "on", "off")
"""The values of ``DSparkConfig.rotary_epilogue``."""


@dataclass(frozen=True)
class DSparkConfig:
    """How ``dspark_compile`` builds and runs a verifier."""

    page_size: int = 16
    """Tokens per KV-cache page of the state pools ``new_state`` allocates."""
    block: int = 8
    """Most tokens a verify step gives one request (draft length + 1); sizes the tier set."""
    lowering: str = "auto"
    """Implementation of the ``dspark::`` ops: ``"triton"`` (CUDA and ROCm), ``"reference"``
    (pure torch: the CPU path and the test oracle) or ``"auto"`` (Triton on a GPU, else the
    reference)."""
    inductor: bool = False
    """Compile the token-wise rest of the packed graph with Inductor (``torch.compile``)."""
    group_linears: str = "auto"
    """Matmuls by weights that share their rows (q, k, v; gate, up):

    - ``"concat"``: one matmul by the weights stacked into one buffer (the parameters become
      row views of it; ``passes/concat_linear.py``), then column slices of the product;
    - ``"triton"``: one ``dspark::linear_group`` each, a Triton kernel streaming the group in
      one launch with split-K (``kernels/linear.py``);
    - ``"off"``: one matmul per weight, as the model wrote it;
    - ``"auto"`` (default): ``"concat"`` with the Triton lowering, ``"off"`` with the reference
      one (so the CPU reference stays bitwise equal to the dense graph; the stacked GEMM may
      sum in another order).

    Chosen by ``python benchmarks/step_variants.py``; figures in docs/tuning.md.
    """
    rotary: str = "auto"
    """Where a layer's rotary runs: ``"inductor"`` (the packed graph's own ops, fused by
    Inductor when ``inductor=True``), ``"triton"`` (``fuse_rotary`` makes each layer's q/k
    rotation one ``dspark::rotary_apply``: one Triton launch on a GPU) or ``"auto"`` (default:
    ``"triton"`` with the Triton lowering, ``"inductor"`` with the reference one).

    Chosen by ``python benchmarks/step_variants.py``; figures in docs/tuning.md."""
    fuse_linears: str = "auto"
    """Each weight's matmul with the RMSNorm or SiLU-and-mul before it and the residual add
    after it: ``"on"`` makes them one ``dspark::skinny_linear`` (``passes/fuse_linear.py``;
    on a GPU one launch of a Triton kernel built for a verify step's few rows, up to
    ``TargetConfig.skinny_max_m`` rows, and the input's launch plus the vendor GEMM above),
    ``"off"`` leaves them to the packed graph, ``"auto"`` (default) is ``"on"`` with the Triton
    lowering and ``"off"`` with the reference one. 16-bit activations only. It costs compile
    time: each matmul kind and row tile is one more Triton kernel to build.

    Chosen by ``python benchmarks/verify_step.py --fuse-linears on|off``; figures in
    docs/tuning.md."""
    rotary_epilogue: str = "auto"
    """``"on"``: each layer's q/k rotation (``rotary="triton"``'s ``dspark::rotary_apply``)
    moves into the q/k/v ``dspark::skinny_linear`` (``fuse_linears`` on), one launch fewer a
    layer (``passes/fuse_linear.py``'s ``fuse_rotary_epilogue``); the op rotates in its
    epilogue from ``TargetConfig.skinny_rope_min_m`` rows (1 on every target), and with fewer
    rows the rotary kernel after the matmul. ``"off"`` keeps the rotary launch; ``"auto"``
    (default) is ``"on"``. On the CPU the verifier equals the one without it bit for bit.

    Chosen by ``python benchmarks/verify_step.py --quick --rotary-epilogue on|off``; figures in
    docs/tuning.md."""
    max_step_tokens: int = 4096
    """Most packed rows (all requests' tokens) one forward may run on a model with
    linear-attention layers: it sizes their replay rings (one saved row per token, per layer),
    so a longer prefill must be split into steps of at most this many tokens."""

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"DSparkConfig.page_size={self.page_size!r}; it must be an int >= 1")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"DSparkConfig.block={self.block!r}; it must be an int >= 1")
        if not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1:
            raise ValueError(f"DSparkConfig.max_step_tokens={self.max_step_tokens!r}; it must "
                             "be an int >= 1")
        if self.group_linears not in GROUP_LINEARS:
            raise ValueError(f"DSparkConfig.group_linears={self.group_linears!r}; it must be one "
                             f"of {', '.join(map(repr, GROUP_LINEARS))}")
        if self.fuse_linears not in FUSE_LINEARS:
            raise ValueError(f"DSparkConfig.fuse_linears={self.fuse_linears!r}; it must be one "
                             f"of {', '.join(map(repr, FUSE_LINEARS))}")
        if self.rotary_epilogue not in ROTARY_EPILOGUE:
            raise ValueError(f"DSparkConfig.rotary_epilogue={self.rotary_epilogue!r}; it must be "
                             f"one of {', '.join(map(repr, ROTARY_EPILOGUE))}")
        if self.rotary not in ROTARY:
            raise ValueError(f"DSparkConfig.rotary={self.rotary!r}; it must be one of "
                             f"{', '.join(map(repr, ROTARY))}")
        if self.lowering not in ("auto", "triton", "reference"):
            raise ValueError(f"DSparkConfig.lowering={self.lowering!r}; it must be 'auto', "
                             "'triton' or 'reference'")

    def with_overrides(self, **overrides) -> "DSparkConfig":
        """A copy with ``overrides`` applied; unknown names are refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"DSparkConfig has no field(s) {unknown}; known: {sorted(known)}")
        return replace(self, **overrides)

    def resolve(self, device_type: str) -> "ResolvedConfig":
        """Every ``"auto"`` decided for a device of ``device_type`` (``"cuda"`` for CUDA and
        ROCm, ``"cpu"``): done once, before the pass pipeline runs.

        ``lowering="auto"`` takes Triton on CUDA and ROCm devices and the reference on the CPU,
        and says which once in the log; ``lowering="triton"`` off a GPU is refused."""
        lowering = self.lowering
        if lowering == "auto":
            lowering = "triton" if device_type == "cuda" else "reference"
            log.info("dspark_compile: lowering=%s on %s", lowering, device_type)
        elif lowering == "triton" and device_type != "cuda":
            raise ValueError(f"lowering='triton' needs a CUDA or ROCm device; the model is on "
                             f"{device_type}. Use lowering='reference' (or 'auto') on the CPU")
        triton = lowering == "triton"
        fuse = self.fuse_linears == "on" or (self.fuse_linears == "auto" and triton)
        return ResolvedConfig(
            lowering=lowering, block=self.block,
            group_linears=("concat" if triton else "off") if self.group_linears == "auto"
            else self.group_linears,
            rotary=("triton" if triton else "inductor") if self.rotary == "auto" else self.rotary,
            fuse_linears=fuse, rotary_epilogue=fuse and self.rotary_epilogue != "off")


@dataclass(frozen=True)
class ResolvedConfig:
    """The pass pipeline's settings: a :class:`DSparkConfig` with every ``"auto"`` decided for
    one device (``DSparkConfig.resolve``). Passes read these; none resolves a setting itself."""

    lowering: str = "reference"
    """``"triton"`` or ``"reference"``."""
    block: int = 8
    """The verify block (the Triton attention's query-tile bound)."""
    group_linears: str = "off"
    """``"concat"``, ``"triton"`` or ``"off"``."""
    rotary: str = "inductor"
    """``"triton"`` or ``"inductor"``."""
    fuse_linears: bool = False
    """Make matmuls with their norm / SiLU-and-mul and residual add ``dspark::skinny_linear``."""
    rotary_epilogue: bool = False
    """Move each q/k rotation into the q/k/v ``dspark::skinny_linear`` (needs fuse_linears)."""


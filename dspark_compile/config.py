"""Configuration of a compiled verifier (frozen: build a new one to change it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["DSparkConfig"]


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
    group_linears: bool = False
    """Rewrite matmuls by weights that share their rows (q, k, v; gate, up) into one
    ``dspark::linear_group`` each; on a GPU a small verify batch then streams q+k+v in one
    Triton launch (2.3x faster than three ``torch.mm`` at 3 rows on an H200, kernel alone:
    ``benchmarks/linear_kernel.py``). Off by default until a whole verify step is measured
    with it."""
    rotary: str = "inductor"
    """Where a layer's rotary runs: ``"inductor"`` (the packed graph's own ops, fused by
    Inductor when ``inductor=True``) or ``"triton"`` (``fuse_rotary`` makes each layer's q/k
    rotation one ``dspark::rotary_apply``: one Triton launch on a GPU). In-graph on an H200 the
    Inductor rotary kernels took 2.8 / 7.8 / 18.1 us per layer at bs 1 / 64 / 256 and the Triton
    kernel alone 2.4 / 3.4 / 8.9 (``benchmarks/rotary.py``); ``"inductor"`` stays the default
    until a whole step is measured with ``"triton"``."""
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
        if self.rotary not in ("inductor", "triton"):
            raise ValueError(f"DSparkConfig.rotary={self.rotary!r}; it must be 'inductor' or "
                             "'triton'")
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

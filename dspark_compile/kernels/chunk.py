"""Triton pieces shared by the chunk forms of the GDN and SSD verify forwards.

A chunk form handles a request of up to ``BLOCK_T`` rows at once, from the state before them,
with tensor-core products in place of the token-serial walk. Both recurrences decay the
state by a per-row factor ``exp(l_t)`` (``l_t`` the row's log decay), so row ``t`` sees the
state of the chunk's start through ``exp(l_1 + .. + l_t)`` and an earlier row ``i``'s update
through ``exp(l_{i+1} + .. + l_t)``. Those sums are taken directly over masked rows, never as
differences of prefix sums: a ``-inf`` log decay (a row that forgets everything) then gives 0,
not ``-inf - (-inf)``, and no prefix's rounding cancels.

Rows at or after a request's first non-finite row are zeroed before any product: a product
over rows multiplies each later row by a structural zero, and ``0 * NaN`` is NaN, so without
this a NaN in a rejected draft would reach the accepted rows before it. Those rows' outputs are
then written as NaN (what the recurrence gives them), and the rows before are bit for bit what
they are without the poisoned rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_decays(logd, BLOCK_T: tl.constexpr):
    """From a ``[BLOCK_T]`` vector of per-row log decays (0 on rows past the request):
    ``ratio[t, i] = exp(sum_{i < m <= t} logd[m])`` for ``i <= t`` (0 above the diagonal)
    and ``start[t] = exp(sum_{m <= t} logd[m])`` (the chunk start's weight in row t).

    The window sums are one float32 product, ``(upto * logd) @ after``, of 0/1 masks with the
    log decays (``upto[t, m] = m <= t``, ``after[m, i] = m > i``): each sum is its own terms
    only, never a difference of prefix sums. A ``-inf`` log decay is taken as ``-1e30`` (its
    exponential is still 0) so that the zeros of the masks multiply finite values."""
    offs = tl.arange(0, BLOCK_T)
    logd = tl.maximum(logd, -1e30)
    upto = offs[None, :] <= offs[:, None]  # [t, m]
    after = offs[:, None] > offs[None, :]  # [m, i]
    windows = tl.where(upto, logd[None, :], 0.0)
    sums = tl.dot(windows, tl.where(after, 1.0, 0.0), input_precision="ieee")
    ratio = tl.where(offs[:, None] >= offs[None, :], tl.exp(sums), 0.0)
    return ratio, tl.exp(tl.sum(windows, 1))


@triton.jit
def halves(x, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr):
    """The first and last ``BLOCK_T`` rows of a ``[2 BLOCK_T, WIDTH]`` tile."""
    pair = tl.permute(tl.reshape(x, [2, BLOCK_T, WIDTH]), (1, 2, 0))
    return tl.split(pair)


@triton.jit
def non_finite(x):
    """Per element: NaN or +-Inf."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def first_bad_row(bad, BLOCK_T: tl.constexpr):
    """The first row flagged in ``bad`` (``BLOCK_T`` if none)."""
    offs = tl.arange(0, BLOCK_T)
    return tl.min(tl.where(bad, offs, BLOCK_T), 0)


@triton.jit
def unit_lower_inverse(a, BLOCK_T: tl.constexpr, LOG2_T: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower triangular ``[BLOCK_T, BLOCK_T]`` ``a``: ``a`` is
    nilpotent (``a^BLOCK_T = 0``), so the inverse is ``(I - a)(I + a^2)(I + a^4)...``, the
    product of ``LOG2_T`` factors; every product is lower triangular, so rows never see later
    rows (entries above the diagonal stay exact zeros)."""
    offs = tl.arange(0, BLOCK_T)
    eye = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    inv = eye - a
    power = a
    for _ in tl.static_range(LOG2_T - 1):
        power = tl.dot(power, power, input_precision="ieee")
        inv = tl.dot(inv, eye + power, input_precision="ieee")
    return inv


def log2_rows(block_t: int) -> int:
    """``log2(block_t)`` for a power-of-two chunk of rows."""
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"chunk rows {block_t}: must be a power of two >= 16 (tl.dot's minimum)")
    return block_t.bit_length() - 1

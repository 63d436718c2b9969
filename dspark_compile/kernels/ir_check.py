"""A check of Triton's IR for a construct some Triton releases compile wrong.

Triton 3.5.1, 3.6.0 (torch 2.11's) and 3.7.1 drop a scalar carried through a loop whose only
reads in the loop are the bounds of an inner loop, when nothing reads its final value after
the loop: ``tritongpu-remove-layout-conversions`` replaces it by its initial value, so
``for p: for t in range(pid - d, n, nprog): ...; d += n`` runs as ``range(pid, n, nprog)``
in every iteration, a silent wrong result. 3.8.0 and 3.9.0 keep it. The check reads the IR
before the GPU passes (``asm["ttir"]``), so it finds the construct whatever Triton compiled it.

Every ahead-of-time compile of the tests runs :func:`bound_only_carries` on every kernel, and
:func:`~dspark_compile.kernels.launch.launch` runs :func:`check_compiled` on each kernel Triton
compiles at run time where the installed Triton is older than 3.8: a kernel that holds the
construct is refused by name instead of run.
"""

from __future__ import annotations

import re

import triton

__all__ = ["bound_only_carries", "check_compiled", "triton_drops_bound_only_carries"]

_NAME = r"%[A-Za-z0-9_.$-]+(?:#\d+)?"
_FOR = re.compile(r"^\s*(?:(%[A-Za-z0-9_.$-]+)(?::(\d+))? = )?scf\.for (%[\w.$-]+) = (" + _NAME
                  + r") to (" + _NAME + r") step (" + _NAME + r")(?:\s+iter_args\((.*?)\))?"
                  r"(?:\s*->\s*\((.*?)\))?\s*:")
_RESULTS = re.compile(r"^\s*%[A-Za-z0-9_.$-]+(?::\d+)?(?:, %[A-Za-z0-9_.$-]+(?::\d+)?)* = ")


def _top_level(text: str) -> list[str]:
    """``text`` split at the commas outside any brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "<([{") - (ch in ">)]}")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()] if cur.strip() else parts


def bound_only_carries(ttir: str) -> list[str]:
    """The scalar loop-carried values of ``ttir`` (Triton IR text, before the GPU passes) whose
    only reads in the loop are the bounds of an inner ``scf.for`` (through any arithmetic) and
    whose final value nothing reads after the loop (the module docstring says why). A read
    anywhere else (a store, an address, a branch, another loop's initial value, or the final
    value after the loop) keeps such a value in every Triton, so it is not reported."""
    lines = [line.split(" loc(")[0] for line in ttir.splitlines() if not line.startswith("#loc")]
    uses: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        rhs = line.split(" = ", 1)[1] if _RESULTS.match(line) else line
        for name in set(re.findall(_NAME, rhs)):
            uses.setdefault(name, []).append(i)
    found = []
    for i, line in enumerate(lines):
        loop = _FOR.match(line)
        if not loop or not loop.group(7):
            continue
        result, count = loop.group(1), loop.group(2)
        carried = [arg.split(" = ")[0] for arg in _top_level(loop.group(7))]
        for j, (arg, kind) in enumerate(zip(carried, _top_level(loop.group(8) or ""))):
            final = (f"{result}#{j}" if count else result) if result else None
            if "tensor" in kind or "ptr" in kind or (final and uses.get(final)):
                continue
            seen, work, bound, other = {arg}, [arg], False, False
            while work:
                value = work.pop()
                for k in uses.get(value, ()):
                    use = lines[k]
                    inner = _FOR.match(use)
                    if inner:
                        bound |= value in inner.group(4, 5, 6)
                        inits = [a.split(" = ")[1] for a in _top_level(inner.group(7) or "")]
                        other |= value in inits
                    elif "scf.yield" in use:
                        continue
                    elif _RESULTS.match(use):
                        for name in re.findall(r"%[A-Za-z0-9_.$-]+(?=(?::\d+)?(?:,| =))",
                                               use.split(" = ")[0] + " ="):
                            if name not in seen:
                                seen.add(name)
                                work.append(name)
                    else:
                        other = True
            if bound and not other:
                found.append(f"{arg} of line {i + 1}: {line.strip()[:100]}")
    return found


def triton_drops_bound_only_carries(version: str | None = None) -> bool:
    """Whether Triton ``version`` (default: the installed one) may drop such a carry: older
    than 3.8 (3.5.1-3.7.1 were seen to; older ones were not tried, so they count)."""
    text = version if version is not None else triton.__version__
    major, minor = (int(v) for v in re.match(r"(\d+)\.(\d+)", text).groups())
    return (major, minor) < (3, 8)


_checked: dict[int, object] = {}
"""Every compiled kernel :func:`check_compiled` passed, by ``id`` (held, so that an ``id`` is not
reused by another object while it is here; Triton's cache holds them anyway)."""


def check_compiled(compiled) -> None:
    """Raise ``RuntimeError`` naming the kernel when ``compiled`` (a Triton ``CompiledKernel``)
    holds a carry :func:`bound_only_carries` finds; once per compiled kernel. Kernels without
    Triton IR text (none under the interpreter) pass."""
    if _checked.get(id(compiled)) is compiled:
        return
    asm = getattr(compiled, "asm", None)
    ttir = asm.get("ttir") if isinstance(asm, dict) else None
    if isinstance(ttir, str):
        found = bound_only_carries(ttir)
        if found:
            name = getattr(getattr(compiled, "metadata", None), "name", None) or "a kernel"
            raise RuntimeError(
                f"{name}: triton {triton.__version__} compiles it wrong: a loop-carried scalar "
                f"whose only reads are an inner loop's bounds ({found[0]}) is dropped by "
                f"triton 3.5-3.7 (dspark_compile.kernels.ir_check); the kernel was refused. "
                f"Triton 3.8 or newer compiles it as written")
    _checked[id(compiled)] = compiled

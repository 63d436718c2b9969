"""Capture a model's dense verify forward as an aten FX graph with symbolic ``bs`` and ``T``.

The captured function is::

    dense_verify(*params, *buffers, input_ids [bs, T], positions [bs, T],
                 block_table [bs, pages], context_lens [bs], *k_pools, *v_pools,
                 *compress_pools,                                 # DeepSeek-V4 HCA / CSA
                 *index_pools,                                    # DSA indexer keys
                 [slots [bs], *conv_states, *recurrent_states],   # hybrid models only
                 [vision_embeds [bs, T, hidden]])                 # mRoPE models only
        -> logits [bs, T, V]

mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) take ``positions [3, bs, T]`` instead.

Inputs are fake tensors: ``bs`` and ``T`` are fresh symbols, every other size is static. The
sample sizes (3 and 5) are distinct from each other and from 0/1, so that neither gets
specialised or merged with another size by duck sizing. After tracing, any guard that
constrains ``bs`` or ``T`` is an error: the graph would be valid only for the sampled shape.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import dataclass
from typing import Iterator

import sympy
import torch
from torch._decomp import get_decompositions
from torch._dispatch.python import enable_python_dispatcher
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..graph_inputs import InputKind, InputSpec, fake_input, name_placeholders
from ..specs import AttentionSpec, PositionLimit, compress_pools, index_pools
from .adapters import ModelAdapter
from .guards import describe, locate, needs_locating, token_names
from .evaluate import evaluate_node
from .own_forward import cache_window_limit, check_own_forward
from .position_tables import token_id_limit
from .rotary import fixed_rotaries, short_frequencies
from .recurrent import check_linear_calls
from .scope import CaptureScope, open_scope

__all__ = ["CapturedGraph", "capture_dense", "evaluate_node", "SAMPLE_BS", "SAMPLE_T"]

log = logging.getLogger("dspark_compile")

SAMPLE_BS = 3
SAMPLE_T = 5

DECOMPOSED = get_decompositions([torch.ops.aten.log_sigmoid_forward])
"""Ops traced as torch's own decompositions: ``log_sigmoid_forward`` returns a second output
(a buffer for its backward) and is not tagged pointwise; decomposed it is ``min(x, 0) -
log1p(exp(-|x|))``, plain pointwise ops the token-axis proof knows."""
_SAMPLE_PAGES = 2
_SAMPLE_PAGE_SIZE = 4


@dataclass
class CapturedGraph:
    """A dense verify graph and what its placeholders are."""

    gm: fx.GraphModule
    inputs: list[InputSpec]
    bs: sympy.Symbol
    """The symbol of the request axis."""
    tokens: sympy.Symbol
    """The symbol of the per-request token axis ``T``."""
    cache_limit: PositionLimit | None = None
    """Contexts past which the model's own cache drops keys its forward reads
    (:func:`~.own_forward.cache_window_limit`), None: none."""
    id_limit: tuple[int, str] | None = None
    """``(ids, table)``: token ids past ``ids - 1`` would read past a table the ids index
    directly (:func:`~.position_tables.token_id_limit`), None: no such table."""
    unread: frozenset[str] = frozenset()
    """Model tensor names the graph does not read even where they hold a tensor it reads: a
    longrope rotary's ``inv_freq``, read as its short factors (:func:`~.rotary.short_frequencies`),
    which HF swaps or overwrites between forwards."""


def _sample_inputs(adapter: ModelAdapter, dtype: torch.dtype, device: torch.device):
    """Real (small) sample tensors of the dense verify inputs, with their specs."""
    ids = torch.zeros(SAMPLE_BS, SAMPLE_T, dtype=torch.int64, device=device)
    positions = (ids.clone(), (0, 1)) if adapter.mrope is None else (
        torch.zeros(adapter.mrope.sections, *ids.shape, dtype=torch.int64, device=device), (1, 2))
    meta = [
        (InputSpec("input_ids", "input_ids"), ids, (0, 1)),
        (InputSpec("positions", "positions"), *positions),
        (InputSpec("block_table", "block_table"),
         torch.zeros(SAMPLE_BS, _SAMPLE_PAGES, dtype=torch.int32, device=device), (0,)),
        (InputSpec("context_lens", "context_lens"),
         torch.zeros(SAMPLE_BS, dtype=torch.int32, device=device), (0,)),
    ]
    pages = SAMPLE_BS * _SAMPLE_PAGES
    for kind in ("k_cache", "v_cache"):
        for i, s in enumerate(adapter.specs or ()):
            dim = s.head_dim if kind == "k_cache" else s.value_dim
            pool = torch.zeros(pages, _SAMPLE_PAGE_SIZE, s.num_kv_heads, dim,
                               dtype=dtype, device=device)
            meta.append((InputSpec(kind, f"{kind}_{i}"), pool, ()))
    for j, (_, width) in enumerate(compress_pools(adapter.specs)):
        pool = torch.zeros(pages, _SAMPLE_PAGE_SIZE, width, dtype=dtype, device=device)
        meta.append((InputSpec("compress_pool", f"compress_pool_{j}"), pool, ()))
    for j, (_, width) in enumerate(index_pools(adapter.specs)):
        pool = torch.zeros(pages, _SAMPLE_PAGE_SIZE, width, dtype=dtype, device=device)
        meta.append((InputSpec("index_pool", f"index_pool_{j}"), pool, ()))
    if adapter.linear_specs:
        meta += _linear_samples(adapter, dtype, device)
    if adapter.mrope is not None:
        meta.append((InputSpec("vision_embeds", "vision_embeds"),
                     torch.zeros(*ids.shape, adapter.mrope.hidden_size, dtype=dtype,
                                 device=device), (0, 1)))
        if adapter.mrope.deepstack_layers:
            meta.append((InputSpec("deepstack_embeds", "deepstack_embeds"),
                         torch.zeros(adapter.mrope.deepstack_layers, *ids.shape,
                                     adapter.mrope.hidden_size, dtype=dtype, device=device),
                         (1, 2)))
    return meta


def _linear_samples(adapter: ModelAdapter, dtype: torch.dtype, device: torch.device):
    """``slots [bs]`` and each linear layer's conv and recurrent pools (``SAMPLE_BS`` rows)."""
    meta = [(InputSpec("slots", "slots"),
             torch.zeros(SAMPLE_BS, dtype=torch.int32, device=device), (0,))]
    for i, s in enumerate(adapter.linear_specs):
        meta.append((InputSpec("conv_state", f"conv_state_{i}"),
                     torch.zeros(SAMPLE_BS, s.conv_dim, max(s.conv_width - 1, 0),
                                 dtype=s.conv_dtype or dtype, device=device), ()))
    for i, s in enumerate(adapter.linear_specs):
        meta.append((InputSpec("recurrent_state", f"recurrent_state_{i}"),
                     torch.zeros(SAMPLE_BS, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                                 dtype=torch.float32, device=device), ()))
    return meta


def _scope_of(adapter: ModelAdapter, specs: list[InputSpec], values,
              discovered: list[AttentionSpec] | None = None) -> CaptureScope:
    """The capture scope over the dense-input values, found by their input kinds."""
    by_kind: dict[str, list] = {}
    for spec, value in zip(specs, values):
        by_kind.setdefault(spec.kind, []).append(value)
    first: dict[int, int] = {}
    for j, (layer, _) in enumerate(compress_pools(adapter.specs)):
        first.setdefault(layer, j)
    return CaptureScope(
        compress_pools=by_kind.get("compress_pool", []), compress_index=first,
        index_pools=by_kind.get("index_pool", []),
        index_index={layer: j for j, (layer, _) in enumerate(index_pools(adapter.specs))},
        kv_caches=list(zip(by_kind.get("k_cache", []), by_kind.get("v_cache", []))),
        block_table=by_kind["block_table"][0], context_lens=by_kind["context_lens"][0],
        pool_index={k: i for i, k in enumerate(adapter.keys or ())},
        slots=by_kind.get("slots", [None])[0],
        conv_states=by_kind.get("conv_state", []),
        recurrent_states=by_kind.get("recurrent_state", []),
        vision_embeds=by_kind.get("vision_embeds", [None])[0],
        deepstack_embeds=by_kind.get("deepstack_embeds", [None])[0],
        site_names=adapter.site_names, discovered=discovered,
    )


def discover_attention(adapter: ModelAdapter, dtype: torch.dtype,
                       device: torch.device) -> list[AttentionSpec]:
    """Run the dense forward once over fake tensors (no trace) and return one spec per
    attention call, in call order: heads, q/k and v head dims, window, softcap and sinks as
    that call passed them. Every refusal of the attention whitelist fires here first."""
    model = adapter.model
    samples = _sample_inputs(adapter, dtype, device)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    params = {n: fake_input(mode, t, "") for n, t in model.named_parameters()}
    buffers = {n: fake_input(mode, t, "") for n, t in model.named_buffers()}
    values = [fake_input(mode, t, spec.name, dyn) for spec, t, dyn in samples]
    found: list[AttentionSpec] = []
    scope = _scope_of(adapter, [s for s, _, _ in samples], values, discovered=found)

    def call(*args, **kwargs):
        return torch.func.functional_call(model, (params, buffers), args, kwargs)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), mode, enable_python_dispatcher(), adapter.hooks(), \
                open_scope(scope), _refuse_model_failures(adapter):
            adapter.forward(call, values[0], values[1])
    finally:
        model.train(was_training)
    _check_no_pending(scope)
    if not found and not adapter.linear_specs:
        raise TypeError(
            f"dspark_compile: no module of {type(adapter.model).__name__} called the attention "
            "function during a forward, and it has no recurrent layers (Gated DeltaNet, Mamba-2, "
            "short conv): there is no attention whose KV cache dspark_compile could own (a "
            "model computing attention outside transformers' attention interface is not "
            "supported)")
    return found


def _drop_empty_cats(gm: fx.GraphModule) -> None:
    """``cat([x, e], dim)`` where every operand but ``x`` has a static size 0 along ``dim`` is a
    contiguous copy of ``x``: written so. A DeepSeek-V4 compressed layer concatenates its
    (captured as zero-length) compressed entries onto its window keys along the token axis;
    the entries reach the attention op by other means (``frontend/compressed.py``)."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        rank = node.meta["val"].dim()
        kept = [t for t in tensors
                if not (type(t.meta["val"].shape[dim % rank]) is int
                        and t.meta["val"].shape[dim % rank] == 0)]
        if len(kept) != 1 or len(tensors) == 1:
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(aten.clone.default, (kept[0],),
                                          {"memory_format": torch.contiguous_format})
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy)
        gm.graph.erase_node(node)


_MOVES = {torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default, torch.ops.aten.squeeze.dim,
          torch.ops.aten.squeeze.dims, torch.ops.aten.permute.default,
          torch.ops.aten.transpose.int, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
          torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.t.default}
"""Ops that only place a tensor's values (no arithmetic): the same on any device."""


def _device_of(node) -> torch.device | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.device if isinstance(val, torch.Tensor) else None


def _host_constant(node: fx.Node, memo: dict) -> bool:
    """Whether ``node``'s value is the same on every call: no input, parameter or buffer behind
    it (those are placeholders), no symbolic size, no random op."""
    if node in memo:
        return memo[node]
    if node.op == "get_attr":  # a constant the model made (torch.tensor([...]))
        ok = True
    elif node.op != "call_function":
        ok = False
    else:
        val = node.meta.get("val")
        shaped = isinstance(val, torch.Tensor) and all(type(s) is int for s in val.shape)
        seeded = isinstance(node.target, torch._ops.OpOverload) and \
            torch.Tag.nondeterministic_seeded in node.target.tags
        ok = shaped and not seeded and all(
            _host_constant(a, memo) for a in node.all_input_nodes)
        for a in (*node.args, *node.kwargs.values()):
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                ok = False
    memo[node] = ok
    return ok


def _moves_to_constant(source: fx.Node, memo: dict) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(constant, moves)``: the host constant that ``source`` is, or the one it is placed
    from by ``_MOVES`` ops whose other arguments are sizes (an ``expand`` to the batch size:
    transformers 5.17's Phi-MoE rotary); None if a value behind it varies."""
    moves = []
    while not _host_constant(source, memo):
        if source.op != "call_function" or source.target not in _MOVES or \
                not isinstance(source.args[0], fx.Node) or any(
                    isinstance(n.meta.get("val"), torch.Tensor)
                    for n in source.all_input_nodes if n is not source.args[0]):
            return None
        moves.append(source)
        source = source.args[0]
    return source, moves[::-1]


def _fold_host_constants(gm: fx.GraphModule, mode: FakeTensorMode | None = None) -> list[str]:
    """A value the forward makes on the host and copies to the model's device on every call
    (Phi-MoE computes its rotary frequencies with ``torch.arange`` on the CPU and moves them
    with ``.to(x.device)``) is computed once here, by the same ops on the same device, moved
    once, and read as a constant (lifted as ``torch.tensor([...])`` constants are). The
    per-call copy would be a host-to-device transfer from pageable memory, which a CUDA graph
    cannot capture. Ops that only place values (``_MOVES``: an expand to the batch size) between
    the constant and the copy are replayed on the device copy; the copy keeps its dtype change.
    ``mode``: the trace's fake mode (default: the placeholders'). Returns the constants' names."""
    from torch._guards import detect_fake_mode

    memo: dict = {}
    values: dict = {}
    if mode is None:
        try:
            mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes
                                     if n.op == "placeholder"])
        except AssertionError:  # values of several modes: new values are computed without one
            mode = None

    folded = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default or \
                not isinstance(node.args[0], fx.Node):
            continue
        device = _device_of(node)
        if device is None or _device_of(node.args[0]) == device:
            continue
        found = _moves_to_constant(node.args[0], memo)
        if found is None:
            continue
        constant, moves = found
        try:
            with torch.no_grad():
                tensor = evaluate_node(gm, constant, values).to(device)
        except Exception as err:  # noqa: BLE001 - the copy stays; said once, by name
            log.warning("dspark_compile: the host value %s copied to %s on every call could not "
                        "be computed once at capture (%s: %s); the copy stays in the graph, "
                        "which a CUDA graph cannot capture", constant.name, device,
                        type(err).__name__, err)
            continue
        name = f"_dspark_host_constant{len(folded)}"
        gm.register_buffer(name, tensor)
        with gm.graph.inserting_before(node):  # read as torch.tensor([...]) constants are:
            const = gm.graph.get_attr(name)    # a fake-mode retrace lifts it to a fake tensor
            last = gm.graph.call_function(torch.ops.aten.lift_fresh_copy.default, (const,))
            fake = mode.from_tensor(tensor) if mode is not None else tensor
            last.meta = {**constant.meta, "val": fake}
            for move in moves:
                args = (last, *move.args[1:])
                new = gm.graph.call_function(move.target, args, dict(move.kwargs))
                with mode or contextlib.nullcontext():
                    fake = move.target(*fx.node.map_arg(
                        args, lambda n: n.meta["val"]), **move.kwargs)
                new.meta = {**move.meta, "val": fake}
                last = new
        node.args = (last, *node.args[1:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
        folded.append(name)
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded


def _check_no_pending(scope: CaptureScope) -> None:
    if scope.pending_compressed is not None:
        module = scope.pending_compressed[0]
        raise NotImplementedError(
            f"compressor {scope.site_names.get(id(module), '?')!r} ran but no attention call "
            "of its layer followed; its entries would be attended by nothing")


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _model_frame(tb) -> str | None:
    """``file:line in function: code`` of the innermost frame of ``tb`` in the model's own code
    (neither torch nor dspark_compile), None when the failure started in dspark_compile."""
    frames = traceback.extract_tb(tb)
    if frames and os.path.abspath(frames[-1].filename).startswith(_OURS):
        return None
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_OURS, _TORCH)) and "importlib" not in path:
            short = "/".join(path.split(os.sep)[-3:])
            return f"{short}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return None


_REAL_TENSOR = "Please convert all Tensors to FakeTensors"
"""torch's fake-tensor mode meeting a real tensor (one the model keeps as a plain attribute)."""


@contextlib.contextmanager
def _refuse_model_failures(adapter: ModelAdapter) -> Iterator[None]:
    """A model whose forward fails under the capture is refused at its own line: code that uses
    the attention mask as a tensor (the capture proves masks and builds none: plain causal is
    None), that branches on data (a guard on a value only known at run time), or that computes
    with a tensor it holds outside its parameters and buffers (fake-tensor mode meets a real
    one: TrOCR's sinusoid table). A failure inside dspark_compile itself is not a refusal and
    propagates as it is."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        yield
    except (TypeError, AttributeError, IndexError, GuardOnDataDependentSymNode,
            AssertionError) as err:
        where = _model_frame(err.__traceback__)
        held = isinstance(err, AssertionError) and _REAL_TENSOR in str(err)
        if where is None or (isinstance(err, AssertionError) and not held):
            raise
        mask = "Mask" in str(err) or "NoneType" in str(err)
        what = ("computes with a tensor it holds outside its parameters and buffers (a plain "
                "attribute), which the capture cannot take as an input" if held else
                "uses its attention mask outside the attention function (dspark_compile "
                "proves masks instead of building them: plain causal is None, a window a proof "
                "object), which is not supported" if mask else
                "branches on a value known only at run time (data-dependent control flow or "
                "shapes), which one captured graph cannot hold" if isinstance(
                    err, GuardOnDataDependentSymNode) else
                "fails while being captured")
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise NotImplementedError(
            f"{type(adapter.model).__name__} {what}: {type(err).__name__}: {first[:200]} at "
            f"{where}; the model is refused") from err


def capture_dense(adapter: ModelAdapter, dtype: torch.dtype,
                  device: torch.device) -> CapturedGraph:
    """Trace ``adapter``'s dense verify forward into an aten graph (see module docstring).
    A model whose attention layers are not known yet (Hugging Face) is first run once to
    discover them (:func:`discover_attention`)."""
    if adapter.specs is None:
        adapter.specs = discover_attention(adapter, dtype, device)
        adapter.keys = list(range(len(adapter.specs)))
    model = adapter.model
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    shorts = short_frequencies(model, buffers)  # a longrope rotary reads its short factors
    specs = [InputSpec("param", n) for n in params] + [InputSpec("buffer", n) for n in buffers]
    samples = _sample_inputs(adapter, dtype, device)
    specs += [s for s, _, _ in samples]

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    fakes = [fake_input(mode, t, "") for t in (*params.values(), *buffers.values())]
    fakes += [fake_input(mode, t, spec.name, dyn) for spec, t, dyn in samples]
    n_p, n_b = len(params), len(buffers)

    def dense_verify(*flat):
        p = dict(zip(params, flat[:n_p]))
        b = dict(zip(buffers, flat[n_p:n_p + n_b]))
        b.update((freq, b[short]) for freq, short in shorts.items())
        ids, pos = flat[n_p + n_b:n_p + n_b + 2]
        scope = _scope_of(adapter, specs[n_p + n_b:], flat[n_p + n_b:])

        def call(*args, **kwargs):
            return torch.func.functional_call(model, (p, b), args, kwargs)

        with adapter.hooks(), open_scope(scope):
            logits = adapter.forward(call, ids, pos)
        if adapter.kind == "hf" and scope.attention_calls != len(adapter.specs):
            raise RuntimeError(
                f"the forward made {scope.attention_calls} attention calls while captured but "
                f"{len(adapter.specs)} when its layers were discovered; the forward must make "
                "the same calls every time")
        check_linear_calls(scope, adapter.linear_specs)
        _check_no_pending(scope)
        return logits

    was_training = model.training
    model.eval()
    try:
        # Factory calls inside the model (torch.arange, ...) must make fake tensors too.
        # The python dispatcher keeps sizes symbolic through composite ops (F.linear's size()
        # calls specialised bs and T on torch 2.11 without it).
        with torch.no_grad(), mode, enable_python_dispatcher(), \
                _refuse_model_failures(adapter):
            gm = make_fx(dense_verify, tracing_mode="real", record_stack_traces=True,
                         decomposition_table=DECOMPOSED)(*fakes)
    finally:
        model.train(was_training)
    _drop_empty_cats(gm)
    _fold_host_constants(gm, mode)
    gm.graph.eliminate_dead_code()
    name_placeholders(gm, specs)
    gm.recompile()
    bs, tokens = _token_symbols(gm, mode.shape_env)
    _check_guards(mode.shape_env, bs, tokens, gm)
    id_limit = token_id_limit(gm)
    if adapter.kind == "hf":  # after the capture's own refusals, which name more
        with fixed_rotaries(adapter.model):  # a probe past a dynamic rotary's bound: as built
            check_own_forward(adapter.model, adapter.forward,
                              adapter.mrope.sections if adapter.mrope else None,
                              id_limit[0] if id_limit else None)
    limit = cache_window_limit(adapter.model, adapter.specs) if adapter.kind == "hf" else None
    return CapturedGraph(gm, specs, bs, tokens, limit, id_limit, frozenset(shorts))


def _token_symbols(gm: fx.GraphModule, shape_env: ShapeEnv) -> tuple[sympy.Symbol, sympy.Symbol]:
    ids = next(n for n in gm.graph.nodes if n.meta.get("dspark_input", None) is not None
               and n.meta["dspark_input"].kind == InputKind.INPUT_IDS)
    sizes = ids.meta["val"].shape
    if all(isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)
           for s in sizes):
        return sizes[0].node.expr, sizes[1].node.expr
    # A size the trace fixed: its symbol (before replacement) names the guards that fixed it.
    names, lost = {}, {}
    for axis_name, s in zip(("bs", "T"), sizes):
        symbol = getattr(s.node, "_expr", None) if isinstance(s, torch.SymInt) else None
        if isinstance(symbol, sympy.Symbol):
            names[symbol] = sympy.Symbol(axis_name, integer=True)
            if not isinstance(s.node.expr, sympy.Symbol):
                lost[symbol] = f"its {'batch' if axis_name == 'bs' else 'token'} count " \
                               f"{axis_name} to {s.node.expr}"
    culprits = [i for i, g in enumerate(shape_env.guards) if g.expr.free_symbols & set(lost)]
    if not culprits:
        guards = [f"{g.expr} at {g.sloc}" for g in shape_env.guards][:8]
        raise RuntimeError(
            f"the dense verify forward specialised input_ids to {tuple(sizes)} while being "
            f"captured; replacements {shape_env.replacements}, guards {guards}")
    nodes = locate(gm, shape_env, [i for i in culprits if needs_locating(shape_env.guards[i])])
    found = "; ".join(describe(shape_env.guards[i], nodes.get(i), names) for i in culprits[:4])
    raise NotImplementedError(
        f"the dense verify forward specialised {' and '.join(lost.values())} while being "
        f"captured: {found}. The graph would hold only for that size: write shape-dependent "
        "code without Python branches on the size")


def _check_guards(shape_env: ShapeEnv, bs: sympy.Symbol, tokens: sympy.Symbol,
                  gm: fx.GraphModule | None = None) -> None:
    """Refuse a capture that is valid only for the sampled bs or T, naming the model line that
    made the guard (a guard raised inside torch is traced back to its op in ``gm``)."""
    for i, guard in enumerate(shape_env.guards):
        expr = shape_env.simplify(guard.expr)
        if expr in (sympy.true, True):
            continue
        if expr.free_symbols & {bs, tokens}:
            node = locate(gm, shape_env, [i]).get(i) if gm is not None and \
                needs_locating(guard) else None
            raise NotImplementedError(
                "the dense verify forward specialises on its batch or token count ("
                f"{describe(guard, node, token_names(bs, tokens), expr)}); write "
                "shape-dependent code without Python branches on the size"
            )

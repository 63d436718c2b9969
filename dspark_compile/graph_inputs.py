"""The graph-input contract: what each placeholder of a dense or packed graph holds.

Every placeholder carries an :class:`InputSpec` in ``node.meta["dspark_input"]``: its
:class:`InputKind` and its name. The capture (``frontend/capture.py``) makes the dense graph's
inputs; a rewriting pass that needs a new input appends a placeholder after the last one (with a
fake value, so shapes keep propagating) and records its spec in the pass context's ``inputs``;
the verifier fills each placeholder by its kind. Frontend, passes and verifier all import this
module, and it imports none of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic

__all__ = ["InputKind", "InputSpec", "WEIGHT_KINDS", "RING_KINDS", "KV_KINDS", "LINEAR_KINDS",
           "COMPRESS_KINDS", "INDEX_KINDS", "REQUEST_KINDS", "WINDOW_KINDS", "find_input", "add_input",
           "query_start_loc", "name_placeholders", "fake_input", "RING_SAMPLE_ROWS"]


class InputKind(str, enum.Enum):
    """What a graph placeholder holds. A ``str`` enum: a kind equals its value."""

    PARAM = "param"
    """A model parameter (by name)."""
    BUFFER = "buffer"
    """A model buffer (by name)."""
    PARAM_CONCAT = "param_concat"
    """Parameters stacked along dim 0 by ``passes/concat_linear.py`` (``InputSpec.parts``)."""
    INPUT_IDS = "input_ids"
    POSITIONS = "positions"
    BLOCK_TABLE = "block_table"
    CONTEXT_LENS = "context_lens"
    K_CACHE = "k_cache"
    V_CACHE = "v_cache"
    SLOTS = "slots"
    """Hybrid models: each request's state-pool row."""
    CONV_STATE = "conv_state"
    RECURRENT_STATE = "recurrent_state"
    VISION_EMBEDS = "vision_embeds"
    """mRoPE models: vision rows that replace token embeddings."""
    DEEPSTACK_EMBEDS = "deepstack_embeds"
    QUERY_START_LOC = "query_start_loc"
    """Added by the ragged passes (the layout)."""
    SEQ_LENS = "seq_lens"
    SLOT_MAPPING = "slot_mapping"
    WINDOW_BLOCK_TABLE = "window_block_table"
    """A sliding window's KV ring: the batch's block table in ring pages (``_<window>``)."""
    WINDOW_SLOT_MAPPING = "window_slot_mapping"
    """A sliding window's KV ring: each row's write slot in ring rows (``_<window>``)."""
    ENTRY_BLOCK_TABLE = "entry_block_table"
    """Compressed layers of one rate: the batch's block table in entry-pool pages
    (``_<rate>``)."""
    MROPE_POSITIONS = "mrope_positions"
    """``flat_mrope`` turns ``positions [3, bs, T]`` into these ``[3, N]``."""
    CONV_RING = "conv_ring"
    GDN_RING_K = "gdn_ring_k"
    GDN_RING_V = "gdn_ring_v"
    GDN_RING_G = "gdn_ring_g"
    GDN_RING_BETA = "gdn_ring_beta"
    SSD_RING_X = "ssd_ring_x"
    """Mamba-2 layers: ``x * dt`` of each packed row (``dspark::ssd``'s replay ring)."""
    SSD_RING_B = "ssd_ring_b"
    SSD_RING_DA = "ssd_ring_da"
    COMPRESS_POOL = "compress_pool"
    """Compressed-attention layers (DeepSeek-V4): raw kv / gate rows and entries, paged like
    the KV pool (``specs.compress_pools`` says which layer and pool each index is)."""
    INDEX_POOL = "index_pool"
    """Sparse-attention layers with their own indexer (DSA): one indexer key per token, paged
    like the KV pool (``specs.index_pools`` says which layer each index is)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


WEIGHT_KINDS = frozenset({InputKind.PARAM, InputKind.BUFFER, InputKind.PARAM_CONCAT})
"""Kinds the model's weights fill."""
KV_KINDS = frozenset({InputKind.K_CACHE, InputKind.V_CACHE})
"""Kinds the state's KV pools fill (``<kind>_<layer>``)."""
LINEAR_KINDS = frozenset({InputKind.CONV_STATE, InputKind.RECURRENT_STATE})
"""Kinds the state's linear-attention pools fill (``<kind>_<layer>``)."""
COMPRESS_KINDS = frozenset({InputKind.COMPRESS_POOL})
"""Kinds the state's compressor pools fill (``compress_pool_<j>``)."""
INDEX_KINDS = frozenset({InputKind.INDEX_POOL})
"""Kinds the state's indexer key pools fill (``index_pool_<j>``)."""
RING_KINDS = frozenset({InputKind.CONV_RING, InputKind.GDN_RING_K, InputKind.GDN_RING_V,
                        InputKind.GDN_RING_G, InputKind.GDN_RING_BETA, InputKind.SSD_RING_X,
                        InputKind.SSD_RING_B, InputKind.SSD_RING_DA})
"""Kinds of the replay rings the ragged linear passes add."""
WINDOW_KINDS = frozenset({InputKind.WINDOW_BLOCK_TABLE, InputKind.WINDOW_SLOT_MAPPING,
                          InputKind.ENTRY_BLOCK_TABLE})
"""Kinds filled from the layout's metadata by name (per ring span; per compression rate)."""
REQUEST_KINDS = frozenset({InputKind.BLOCK_TABLE, InputKind.WINDOW_BLOCK_TABLE,
                           InputKind.ENTRY_BLOCK_TABLE,
                           InputKind.CONTEXT_LENS, InputKind.QUERY_START_LOC,
                           InputKind.SEQ_LENS, InputKind.SLOTS})
"""Kinds that hold one row per request."""

RING_SAMPLE_ROWS = 16
"""Rows of a replay ring's placeholder value. The rings are static-shaped graph inputs; the
state allocates ``max_step_tokens`` rows and the ops need only ``rows >= N``."""


@dataclass(frozen=True)
class InputSpec:
    """One placeholder of a captured or rewritten graph."""

    kind: InputKind
    """What the placeholder holds."""
    name: str
    """Parameter/buffer name, or the kind (with the pool index for caches and rings)."""
    parts: tuple[str, ...] = ()
    """For kind ``param_concat``: the parameters stacked along dim 0 into this input, in
    order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", InputKind(self.kind))  # refuses an unknown kind


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def find_input(gm: fx.GraphModule, kind: InputKind) -> fx.Node | None:
    """The placeholder of input kind ``kind``, or None."""
    return next((n for n in _placeholders(gm) if n.meta["dspark_input"].kind == kind), None)


def add_input(gm: fx.GraphModule, ctx, kind: InputKind, name: str, shape,
              dtype: torch.dtype) -> fx.Node:
    """Append a placeholder ``name`` of kind ``kind`` with a fake value of ``shape``; its spec
    joins ``ctx.inputs``."""
    last = _placeholders(gm)[-1]
    mode = detect_fake_mode([last.meta["val"]])
    with mode:
        val = torch.empty(shape, dtype=dtype, device=last.meta["val"].device)
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    spec = InputSpec(kind, name)
    node.meta["val"], node.meta["dspark_input"] = val, spec
    ctx.inputs.append(spec)
    return node


def query_start_loc(gm: fx.GraphModule, ctx) -> fx.Node:
    """The ``query_start_loc [bs + 1]`` input, added if no earlier pass made it."""
    node = find_input(gm, InputKind.QUERY_START_LOC)
    if node is not None:
        return node
    bs = find_input(gm, InputKind.INPUT_IDS).meta["val"].shape[0]
    return add_input(gm, ctx, InputKind.QUERY_START_LOC, "query_start_loc", (bs + 1,),
                     torch.int32)


def name_placeholders(gm: fx.GraphModule, specs: Sequence[InputSpec]) -> None:
    """Name placeholders after their input specs and remember the spec on each."""
    placeholders = _placeholders(gm)
    assert len(placeholders) == len(specs), (
        f"{len(placeholders)} placeholders but {len(specs)} input specs")
    for node, spec in zip(placeholders, specs):
        node.name = node.target = spec.name.replace(".", "_")
        node.meta["dspark_input"] = spec


def fake_input(mode: FakeTensorMode, t: torch.Tensor, name: str,
               dynamic_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """A fake tensor like ``t`` whose ``dynamic_dims`` are size symbols (the others static).

    Symbols are made explicitly in the shape environment (``from_tensor`` with a symbolic
    context makes none on torch 2.11); equal sample sizes share a symbol (duck sizing), which
    is how ``bs`` is one symbol across input_ids, positions and the block table.
    """
    if not dynamic_dims:
        return mode.from_tensor(t, static_shapes=True)
    env, sizes = mode.shape_env, []
    for d, n in enumerate(t.shape):
        if d not in dynamic_dims:
            sizes.append(int(n))
            continue
        source = ConstantSource(f"dspark_{name}_{d}")
        symbol = env.create_symbol(int(n), source, dynamic_dim=DimDynamic.DYNAMIC)
        sizes.append(env.create_symintnode(symbol, hint=int(n), source=source))
    with mode:
        return torch.empty(sizes, dtype=t.dtype, device=t.device)

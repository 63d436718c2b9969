"""Decoders that count their positions themselves (the BART family's decoders as causal LMs).

``BartDecoder`` and its copies (mBART, PLBart, Blenderbot, Blenderbot-Small, Marian, Pegasus,
MVP, TrOCR's learned table) ignore the positions they are handed: each forward makes ``arange(T) + cache length`` and reads
its position table there. In a dense capture that is one position list for every request, not
each request's own (its committed context plus the row), and the capture refuses the ``arange``.

While such a model is captured, :func:`counted_positions_hooks` replaces its position
embedding's forward with one that reads the table at the capture's per-token positions, the
values the decoder's ``arange`` stands for in a verify, plus the table's offset where its own
forward adds one (BART's 2). Only exact classes are taken, each embedding owned by a decoder of
its family, with the sources this was derived from (transformers 5.24 and 5.17: the decoder's
forward always passes that ``arange``); anything else is refused by name.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from torch import nn

from .replaced import known_forward, source_key, swapped_forward
from .scope import active_scope

__all__ = ["KNOWN_SOURCES", "counted_positions_hooks"]

_LEARNED_OFFSET = frozenset({"7d212c7862914ff0", "57c3406c61faede2"})
"""BART's learned table: ``weight[position + self.offset]`` (5.24, 5.17)."""
_PLAIN = frozenset({"06429e92243994dc", "41fdd387f5d84f7d",  # Blenderbot's learned table
                    "6307e1e648a167f7", "fb59f370f8725dd7"})  # Marian's, Pegasus' sinusoids
"""Tables read at the position itself (5.24, 5.17)."""

FAMILIES = {
    "bart": ("BartLearnedPositionalEmbedding", "BartDecoder"),
    "mbart": ("MBartLearnedPositionalEmbedding", "MBartDecoder"),
    "plbart": ("PLBartLearnedPositionalEmbedding", "PLBartDecoder"),
    "blenderbot": ("BlenderbotLearnedPositionalEmbedding", "BlenderbotDecoder"),
    "blenderbot_small": ("BlenderbotSmallLearnedPositionalEmbedding", "BlenderbotSmallDecoder"),
    "marian": ("MarianSinusoidalPositionalEmbedding", "MarianDecoder"),
    "pegasus": ("PegasusSinusoidalPositionalEmbedding", "PegasusDecoder"),
    "mvp": ("MvpLearnedPositionalEmbedding", "MvpDecoder"),
    "trocr": ("TrOCRLearnedPositionalEmbedding", "TrOCRDecoder"),
}
"""Modeling module -> (position embedding class, decoder class)."""

KNOWN_SOURCES = {
    "embedding": _LEARNED_OFFSET | _PLAIN,
    "BartDecoder": frozenset({"782d6fd442ae095b", "2ece3a0a913944b5"}),
    "MBartDecoder": frozenset({"d424f13ef5dce515", "12a9b03686783dc8"}),
    "PLBartDecoder": frozenset({"782d6fd442ae095b", "2ece3a0a913944b5"}),
    "BlenderbotDecoder": frozenset({"c8c2bd32b2b23d55", "b6e8887b77361fb6"}),
    "BlenderbotSmallDecoder": frozenset({"f4b75f067a653328", "c75acdc49c74bc0a"}),
    "MarianDecoder": frozenset({"0a49830088cbec96", "93556fbce2edb942"}),
    "PegasusDecoder": frozenset({"c69d888c1f6e58d1", "be958c4ec76fe257"}),
    "MvpDecoder": frozenset({"57f37dd0dbfd9f93", "afddd8f92bd2a7c3"}),
    "TrOCRDecoder": frozenset({"d7e8a4da55863b0d", "884dd0697ec909f1"}),
}
"""sha256 prefixes (:func:`~.replaced.source_key`) of the embeddings' and decoders' forwards,
transformers 5.24 and 5.17 (which differ in the cache length's name)."""


def table_at_positions(offsets: dict[int, int]):
    """A position table's replaced forward: the table (an ``nn.Embedding``) read at each
    token's own position from the capture (``[bs, T]``), plus ``offsets[id(table)]``, whatever
    the call's arguments (the ``arange`` they stand for)."""
    def forward(self, *args, **kwargs):
        """The table at each token's own position (module docstring)."""
        scope = active_scope()
        if scope is None or scope.positions is None:
            raise RuntimeError(f"{type(self).__name__}: replaced by dspark_compile for a capture "
                               "and called outside one")
        return nn.Embedding.forward(self, scope.positions + offsets[id(self)])
    return forward


@contextlib.contextmanager
def counted_positions_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Read ``model``'s self-counted position tables at the capture's positions; restored
    after. A model without them is left untouched."""
    with contextlib.ExitStack() as stack:
        for family, (embedding_name, decoder_name) in FAMILIES.items():
            # a model holds this family's modules only where its modeling module is loaded
            modeling = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
            embedding, decoder = (getattr(modeling, embedding_name, None),
                                  getattr(modeling, decoder_name, None))
            if embedding is None or decoder is None:
                continue
            tables = [m for m in model.modules() if isinstance(m, embedding)]
            if not tables:
                continue
            owned = {id(d.embed_positions) for d in model.modules()
                     if type(d) is decoder and
                     known_forward(d, decoder, KNOWN_SOURCES[decoder_name])}
            offsets = {}
            for m in tables:
                key = source_key(embedding) if type(m) is embedding else None
                if id(m) not in owned or "forward" in m.__dict__ or \
                        key not in KNOWN_SOURCES["embedding"]:
                    raise NotImplementedError(
                        f"{type(m).__name__} {names.get(id(m), '?')!r}: a position table read at "
                        f"positions its decoder counts itself is taken only inside "
                        f"{decoder_name} with the sources of transformers 5.24 and 5.17, and "
                        "this one reads otherwise; the model is refused rather than verified "
                        "wrong")
                offsets[id(m)] = m.offset if key in _LEARNED_OFFSET else 0
            stack.enter_context(swapped_forward(embedding, table_at_positions(offsets)))
        yield

"""token_axis / flatten_tokens: a flat axis of ``bs*T*c`` rows (``c`` sub-rows per token), and
a request axis with a static axis merged in front (``c*bs``).

Qwen3.5's GDN runs its gated norm over ``core_attn_out.reshape(-1, head_v_dim)``, a
``[bs*T*Hv, V]`` value; its flat form is ``[N*Hv, V]``. Merges that do not keep each token's
rows together in token-major order are refused.
"""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dspark_compile import dspark_compile
from dspark_compile.graph_inputs import fake_input
from dspark_compile.passes import RefusedOp
from dspark_compile.passes.token_axis import AxisLabel, label_of
from helpers import PlainBlock, PlainDecoder, Session


def _symbolic(shape_fn):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = fake_input(mode, torch.zeros(3, 5), "x", (0, 1))
    bs, t = x.shape
    with mode:
        val = torch.empty(shape_fn(bs, t))
    return val, bs.node.expr, t.node.expr


@pytest.mark.parametrize("shape_fn,factor", [
    (lambda bs, t: (bs * t, 16), 1),
    (lambda bs, t: (bs * t * 4, 16), 4),
    (lambda bs, t: (4 * bs * t, 2, 8), 4),
])
def test_flat_axis_times_a_static_factor(shape_fn, factor):
    val, bs, t = _symbolic(shape_fn)
    label = label_of(val, bs, t)
    assert isinstance(label, AxisLabel) and label.flat_dim == 0
    assert label.flat_factor == factor and label.kind == "token"


def test_static_axis_merged_before_the_request_axis():
    """transformers 5.17's mRoPE: ``[3, bs, 1, T] -> [3*bs, 1, T]`` for a batched matmul."""
    val, bs, t = _symbolic(lambda bs, t: (3 * bs, 1, t))
    label = label_of(val, bs, t)
    assert (label.bs_dim, label.t_dim, label.bs_factor) == (0, 2, 3)


@pytest.mark.parametrize("shape_fn", [lambda bs, t: (t * 4, 16), lambda bs, t: (bs * t + 4,)])
def test_other_merges_have_no_label(shape_fn):
    val, bs, t = _symbolic(shape_fn)
    assert "merges the token axis" in label_of(val, bs, t)


class HeadNormBlock(PlainBlock):
    """A block whose output heads get an RMSNorm over ``reshape(-1, head_dim)`` rows."""

    def __init__(self, dim, heads, kv_heads, head_major=False):
        super().__init__(dim, heads, kv_heads)
        self.head_norm = nn.RMSNorm(self.head_dim)
        self.head_major = head_major

    def forward(self, x, positions):
        bs, t, _ = x.shape
        y = super().forward(x, positions).view(bs, t, self.heads, self.head_dim)
        if self.head_major:  # rows in (b, h, t) order: not token-major
            y = y.transpose(1, 2)
        y = self.head_norm(y.reshape(-1, self.head_dim))  # [bs*T*H, D]
        y = y.view(bs, self.heads, t, -1).transpose(1, 2) if self.head_major else y
        return y.reshape(bs, t, -1)


def _decoder(head_major=False):
    model = PlainDecoder(vocab=37, dim=32, heads=4, kv_heads=2, layers=1, seed=2)
    model.blocks[0] = HeadNormBlock(32, 4, 2, head_major)
    return model.eval()


def test_per_head_rows_match_own_forward():
    model = _decoder()
    session = Session(model, dspark_compile(model), [2, 0, 1], seed=5)
    session.vocab = 37
    session.step([3, 6, 2], accept=[3, 6, 2])
    for lens in ([2, 5, 1], [4, 1, 3]):
        session.step(lens)
    assert session.max_err < 1e-5


def test_merge_out_of_token_major_order_is_refused():
    with pytest.raises(RefusedOp, match="token-major order"):
        dspark_compile(_decoder(head_major=True))


def test_dim_labels_of_static_and_symbolic_sizes():
    """Each size's label (cached per symbolic expression): static sizes hold no axis, whatever
    their value, and a size mixing the request and token symbols is refused as mixed."""
    from dspark_compile.passes.token_axis import _dim_label

    val, bs, t = _symbolic(lambda bs, t: (bs, bs + 1, t, 3 * bs, 2 * bs * t, bs + t, 15, 3))
    labels = [_dim_label(s, bs, t) for s in val.shape]
    assert labels == [("bs", 1), ("bs", 1), ("t", 1), ("bs", 3), ("flat", 2), ("mixed", 1),
                      None, None]
    assert [_dim_label(s, bs, t) for s in val.shape] == labels  # from the cache: the same

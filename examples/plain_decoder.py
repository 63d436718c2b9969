"""A plain PyTorch decoder made packed-ragged by dspark_compile.

The model author writes attention with ``dspark_compile.nn.CachedAttention`` and every other op
as ordinary torch; ``forward(input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``.

    python examples/plain_decoder.py
"""

import torch
from torch import nn

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.nn import CachedAttention


class Block(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.attn = CachedAttention(heads, kv_heads, self.head_dim)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, 4 * dim), nn.SiLU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x, positions):
        bs, t, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(bs, t, self.heads, self.head_dim)
        k, v = self.kv(h).view(bs, t, 2, self.kv_heads, self.head_dim).unbind(2)
        # A learned-free positional signal: any per-token function of positions is fine.
        q = q + torch.sin(positions.float() / 100).view(bs, t, 1, 1)
        x = x + self.out(self.attn(q, k, v).reshape(bs, t, -1))
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    model = Decoder().eval()
    verifier = dspark_compile(model)
    print(verifier.explain())
    state = verifier.new_state(max_requests=4, max_context=64)
    prompts = [torch.randint(0, 100, (n,)) for n in (6, 11)]
    layout = VerifyLayout.pack([6, 11], [0, 0], [2, 0])
    verifier(torch.cat(prompts), layout, state)
    verifier.commit(layout, [6, 11], state)
    drafts = [torch.randint(0, 100, (n,)) for n in (3, 1)]
    layout = VerifyLayout.pack([3, 1], [6, 11], [2, 0])
    logits = verifier(torch.cat(drafts), layout, state)
    with torch.no_grad():
        seq = torch.cat([prompts[0], drafts[0]])
        want = model(seq[None], torch.arange(seq.numel())[None])[0, -3:]
    print("max |ragged - own forward| for request 0:", (logits[:3] - want).abs().max().item())


if __name__ == "__main__":
    main()

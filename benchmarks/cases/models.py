"""The plain PyTorch models every contestant trains: what a user would write, no megazero layers.

`GPT` is a small causal language model (token + position embedding, pre-norm blocks with causal
self-attention and a GELU MLP, LM head, cross-entropy); `forward(tokens, labels)` returns the mean
loss. `mlp_blocks` is a stack of residual MLP blocks for the pipeline case. Dropout is 0 throughout,
so every framework computes the same function from the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTSize:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128

    def params(self) -> int:
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + 2 * self.vocab * h + self.seq * h + 2 * h + self.vocab


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)  # (b, heads, s, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: GPTSize):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.hidden)
        self.pos = nn.Embedding(size.seq, size.hidden)
        self.blocks = nn.ModuleList(Block(size.hidden, size.heads) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, size.vocab)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (b, s, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt(size: GPTSize, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(size)


def token_batches(size: GPTSize, global_batch: int, steps: int, seed: int = 1) -> list[tuple]:
    """(tokens, labels) of each step's global batch, (global_batch, seq) each."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        t = torch.randint(0, size.vocab, (global_batch, size.seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 LayerNorm(x)) on (rows, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp_blocks(count: int, width: int, seed: int = 0) -> list[nn.Module]:
    """`count` residual MLP blocks, the same values on every rank that builds them."""
    torch.manual_seed(seed)
    return [ResidualMLP(width) for _ in range(count)]


def regression_batches(rows: int, width: int, steps: int, seed: int = 2) -> list[tuple]:
    """(inputs, targets) of each step's global batch, (rows, width) each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)) for _ in range(steps)]

"""A small causal transformer block, on one process: the model lesson 11 splits.

Pre-norm, as GPT-2 and most models since: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.
Activations are sequence-first, ``[T, B, d]`` (see :mod:`pcourse.tensor_parallel`).
Separate q, k, v projections, so that splitting each by its output features splits the
heads, whole, across ranks. No dropout: every run is exactly repeatable.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     n_heads: int) -> torch.Tensor:
    """Multi-head causal self-attention of ``[T, B, n_heads * dh]`` projections.

    Each head attends on its own slice of the features, which is why a rank holding
    whole heads needs nothing from the others until the output projection.
    """
    T, B, width = q.shape

    def heads(x: torch.Tensor) -> torch.Tensor:  # [T, B, h*dh] -> [B, h, T, dh]
        return x.reshape(T, B, n_heads, width // n_heads).permute(1, 2, 0, 3)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(T, B, width)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        if d % n_heads:
            raise ValueError(f"the width ({d}) must divide by the number of heads ({n_heads})")
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(causal_attention(self.q(x), self.k(x), self.v(x), self.n_heads))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """One pre-norm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, d: int = 32, n_heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, n_heads), MLP(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a norm and a head: logits for
    the next token at every position of ``[T, B]`` token ids."""

    def __init__(self, vocab: int = 16, d: int = 48, n_heads: int = 12, hidden: int = 96,
                 layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, n_heads, hidden) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def copy_task(batch: int, length: int, vocab: int = 16, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens ``[T, B]``, and the target at each position: the token before it.

    A task only attention can learn (a token must look back one place), made here, in
    a blink, with no download."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length, batch), generator=gen)
    return tokens, torch.cat([tokens[:1], tokens[:-1]])


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token logits over every position of the batch."""
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

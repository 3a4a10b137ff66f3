"""A tiny deterministic causal language model for the reference worker.

Theory of operation
-------------------
The model exists to make the reference worker *do* something checkable with
each rebuilt request: every rank that receives the same requests must sample
the same tokens, bit for bit.  It is a pre-norm transformer (token embedding
plus a fixed sinusoidal position signal, ``layers`` blocks of single-head
causal attention and a ReLU MLP, RMS norms, an LM head) whose weights come from
a ``torch.Generator`` seeded with ``seed``, so every process builds the same
weights.

Position invariance: everything is computed one position (one row) at a time,
so the tensor shapes every operation sees depend only on the position ``p``,
never on how many positions share a chunk, which chunk a position falls in, or
what else is in the batch.  Row-wise matrix-vector products, reductions and
transcendental functions therefore take identical code paths, and the hidden
state and K/V of position ``p`` are bitwise the same however the sequence was
chunked.  Only exact operations (gathers, copies, elementwise add, ReLU) are
applied to whole chunks.  This is what lets a rejoining worker recompute its KV
cache in one pass and then agree with ranks that built it step by step.

K/V live in caller-owned paged caches: one ``[slots, hidden]`` tensor per layer
for K and one for V, addressed by slot index (the runner maps positions to
slots through block tables).  Float32 throughout; no autograd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V), each [slots, hidden]

_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    """Root-mean-square norm of one row (a 1-D tensor) with a learned gain."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean() + _NORM_EPS) * self.weight


class Block(nn.Module):
    """Pre-norm single-head causal self-attention followed by a ReLU MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.norm1 = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = RMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(hidden)

    def forward(self, x: torch.Tensor, start: int, cache: tuple[torch.Tensor, torch.Tensor],
                slots: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` are positions ``start..start+len(x)``; ``slots[p]`` is p's cache slot.

        Writes this chunk's K/V into ``cache`` first, then attends each row to
        positions ``[0, p]`` read back from the cache.
        """
        k_cache, v_cache = cache
        qkv = _rows(lambda r: self.qkv(self.norm1(r)), x)
        q, k, v = qkv.split(self.hidden, dim=1)
        end = start + x.shape[0]
        k_cache.index_copy_(0, slots[start:end], k.contiguous())
        v_cache.index_copy_(0, slots[start:end], v.contiguous())
        keys = k_cache.index_select(0, slots[:end])
        values = v_cache.index_select(0, slots[:end])
        attn = torch.stack([self._attend(q[i], keys[: start + i + 1], values[: start + i + 1])
                            for i in range(x.shape[0])])
        x = x + _rows(self.out, attn)
        return x + _rows(lambda r: self.fc2(torch.relu(self.fc1(self.norm2(r)))), x)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(keys.mv(q) * self.scale, dim=0)
        return values.t().mv(weights)


class TinyModel(nn.Module):
    """Token embedding, ``layers`` pre-norm blocks, final norm and LM head.

    Args:
        vocab_size: number of token ids (inputs must lie in ``[0, vocab_size)``).
        hidden: model width (even; 64 keeps a CPU step in the milliseconds).
        layers: number of blocks.
        seed: weight seed; the same seed gives bitwise-equal weights in every process.
    """

    inv_freq: torch.Tensor  # sinusoid frequencies [hidden // 2] (a non-persistent buffer)

    def __init__(self, vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        if hidden % 2:
            raise ValueError(f"hidden must be even, got {hidden}")
        self.vocab_size, self.hidden, self.num_layers = vocab_size, hidden, layers
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        inv_freq = torch.pow(10000.0, -torch.arange(0, hidden, 2, dtype=torch.float32) / hidden)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._init_weights(seed)
        self.requires_grad_(False)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Gaussian weights (std 1/sqrt(fan_in)) drawn in parameter order; norm gains stay 1."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                continue
            fan_in = 1 if name == "embed.weight" else param.shape[1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))

    def new_cache(self, slots: int) -> KVCache:
        """Zeroed paged K/V storage for ``slots`` token slots per layer."""
        return [(torch.zeros(slots, self.hidden), torch.zeros(slots, self.hidden))
                for _ in range(self.num_layers)]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache,
                slots: torch.Tensor) -> torch.Tensor:
        """Run positions ``start..start+len(tokens)``; return the last position's hidden state.

        ``cache`` must already hold K/V of positions ``[0, start)`` at
        ``slots[:start]``; this call writes the chunk's K/V at ``slots[start:...]``.
        ``slots`` is an int64 tensor covering at least the chunk's end.
        """
        x = torch.stack([self._embed_row(int(t), start + i)
                         for i, t in enumerate(tokens.tolist())])
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x = block(x, start, layer_cache, slots)
        return x[-1]

    @torch.no_grad()
    def logits(self, hidden_row: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[vocab_size]`` from one final hidden state."""
        return self.head(self.norm(hidden_row))

    def _embed_row(self, token: int, position: int) -> torch.Tensor:
        angle = self.inv_freq * float(position)
        return self.embed.weight[token] + torch.cat([angle.sin(), angle.cos()])


def _rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to each row of ``x`` separately (shape-stable, see module docstring)."""
    return torch.stack([fn(x[i]) for i in range(x.shape[0])])

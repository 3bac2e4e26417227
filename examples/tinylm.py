"""A tiny byte-level decoder-only transformer trained on the Python standard library's own source.

Nothing is downloaded and no data is committed: the text is read at run time
from the ``.py`` files of the running interpreter's standard library.
``unison train examples/tinylm.toml`` uses the three factories below.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 256  # bytes


def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the stdlib's top-level ``.py`` files, in sorted order."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: input = first ``seq_len``, target = next."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def build_datasets(seq_len: int = 64, max_bytes: int = 400_000, val_fraction: float = 0.1) -> tuple[Dataset, Dataset]:
    text = stdlib_text(max_bytes)
    split = int(len(text) * (1 - val_fraction))
    return ByteChunks(text[:split], seq_len), ByteChunks(text[split:], seq_len)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + position embeddings, pre-norm blocks, a head tied to the token embedding."""

    def __init__(self, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, seq_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied weights
        nn.init.normal_(self.tok.weight, std=1 / math.sqrt(d_model))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(d_model: int = 64, n_heads: int = 4, n_layers: int = 2, seq_len: int = 64) -> TinyLM:
    return TinyLM(d_model=d_model, n_heads=n_heads, n_layers=n_layers, seq_len=seq_len)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))

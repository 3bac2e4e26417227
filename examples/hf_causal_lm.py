"""A small Hugging Face causal LM trained with dict batches on its own loss, with no loss code.

The model is a ``transformers`` Llama built from a local config (no download,
dropout off), byte-level (vocabulary of 256 bytes, no tokenizer needed), and
the text is the Python standard library's own source, read at run time.
Each sample is ``{"input_ids", "attention_mask", "labels"}``, which is what
every Hugging Face causal LM takes; the model computes its own loss, and with
neither ``loss_fn`` nor ``training_step`` the trainer normalises it by the step's
global count of labels ``!= -100`` (the Hugging Face Trainer's ``num_items_in_batch``),
so padding and the split over ranks and micro-batches change nothing::

    trainer.fit(build_model, train, optimizer=...)

``unison train examples/hf_causal_lm.toml [--strategy ddp --nproc 2]`` uses the
factories below; ``python examples/hf_causal_lm.py [--strategy NAME] [--max-steps N]``
trains the same model from Python (``unison run --nproc 2 examples/hf_causal_lm.py
--strategy ddp`` on two processes). Needs ``pip install -e '.[hf]'`` in a clone.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB = 256  # bytes


def stdlib_text(max_bytes: int, skip_bytes: int = 0) -> bytes:
    """``max_bytes`` of the stdlib's top-level ``.py`` files in sorted order, after ``skip_bytes``."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= skip_bytes + max_bytes:
            break
    return b"".join(chunks)[skip_bytes : skip_bytes + max_bytes]


class ByteLMDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes as Hugging Face causal-LM samples.

    ``labels`` equal ``input_ids``: the model shifts them itself. Every window
    is full length, so every sample holds the same number of tokens and the
    mean loss of a micro-batch does not depend on how it is split over ranks.
    """

    def __init__(self, data: bytes, seq_len: int) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def build_datasets(seq_len: int = 32, max_bytes: int = 65_536, val_bytes: int = 8_192) -> tuple[Dataset, Dataset]:
    return (
        ByteLMDataset(stdlib_text(max_bytes), seq_len),
        ByteLMDataset(stdlib_text(val_bytes, skip_bytes=max_bytes), seq_len),
    )


def build_model(hidden_size: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 32) -> torch.nn.Module:
    """A tiny Llama causal LM from a local config (nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def training_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The explicit form: each micro-batch's own token mean (the same as the default here, where every window
    is full length; on padded batches prefer the default, which weighs every token alike)."""
    return model(**batch).loss


def main(argv: list[str] | None = None) -> None:
    """Train with the settings of ``hf_causal_lm.toml`` and print the final losses."""
    import unison

    parser = argparse.ArgumentParser(description="Train a tiny Hugging Face Llama on byte-level text.")
    parser.add_argument("--strategy", default="single", help="a registered strategy name (default: single)")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default: 60)")
    args = parser.parse_args(argv)

    train, val = build_datasets()
    trainer = unison.Trainer(
        strategy=args.strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=args.max_steps,
        grad_clip_norm=1.0,
        seed=0,
        log_every_n_steps=10,
    )
    trainer.fit(
        build_model,
        train,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        val_dataset=val,
    )
    if trainer.is_global_zero:
        print(f"validation loss after {args.max_steps} steps: {trainer.last_validation['val/loss']:.4f}")


if __name__ == "__main__":
    main()

"""The workloads people really train: token losses on padded batches, a Hugging Face causal LM, Dropout.

* **Token data** (:func:`token_pairs`, :class:`TokenDicts`): sequences of :data:`LENGTH` positions whose
  valid length is 2..:data:`LENGTH` (drawn per sample), padded with token 0; labels are ``-100`` on
  padding. A micro-batch slice's token mean therefore weighs its tokens by how many the slice holds,
  and a trainer that averaged per-slice means would train another loss for every split.
* **Models**: :class:`TokenLM`, an ``nn.Sequential`` language model (embedding, two tanh MLP blocks,
  vocabulary head) that pipelines cut and tensor parallel splits (a ``tp_plan``); :func:`llama`, a
  one-layer ``transformers`` ``LlamaForCausalLM`` built from a local config (no download), trained
  through the Hugging Face path (its own loss, ``num_items_in_batch``).
* **Losses** (the pair form, :func:`token_loss`): the summed next-token cross entropy and the number
  of valid labels; :func:`token_slice_mean` is the same loss as each slice's own mean, the control a
  ``token_loss`` scenario's reference must end far from.

Everything is tiny (a vocabulary of 32, 12 positions, width 16): the scenarios cost a fraction of a
second per run, and importing ``transformers`` (only when a Hugging Face scenario runs) costs more
than training.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.utils.data import Dataset, TensorDataset

#: Vocabulary size, positions per sequence, model width.
VOCAB, LENGTH, WIDTH = 32, 12, 16

#: The label a loss ignores (padding), as PyTorch and Hugging Face spell it.
IGNORE_INDEX = -100


def _sequences(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, mask)``: ``n`` sequences of valid length 2..LENGTH, padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def token_pairs(n: int, seed: int = 7) -> TensorDataset:
    """``(input_ids, next-token labels)`` pairs: label ``t`` is token ``t + 1``, ``-100`` past the valid length."""
    ids, mask = _sequences(n, seed)
    labels = torch.where(mask.bool(), ids, IGNORE_INDEX)
    shifted = torch.cat([labels[:, 1:], torch.full((n, 1), IGNORE_INDEX)], dim=1)
    return TensorDataset(ids, shifted)


class TokenDicts(Dataset):
    """The same sequences as Hugging Face dict samples: ``input_ids``, ``attention_mask``, ``labels``
    (unshifted: the model shifts them; ``-100`` on padding)."""

    def __init__(self, n: int, seed: int = 7) -> None:
        self.ids, self.mask = _sequences(n, seed)
        self.labels = torch.where(self.mask.bool(), self.ids, IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class TokenLM(torch.nn.Sequential):
    """Embedding -> two tanh MLP blocks -> vocabulary head, as an ``nn.Sequential`` pipelines cut.

    Its ``tp_plan`` splits each block Megatron's way (up colwise, down rowwise); the embedding and the
    head stay whole.
    """

    def __init__(self) -> None:
        def block() -> torch.nn.Sequential:
            return torch.nn.Sequential(
                torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH)
            )

        super().__init__(torch.nn.Embedding(VOCAB, WIDTH), block(), block(), torch.nn.Linear(WIDTH, VOCAB))
        self.tp_plan = {"1.0": "colwise", "1.2": "rowwise", "2.0": "colwise", "2.2": "rowwise"}


def transformers_missing() -> str | None:
    """Why the Hugging Face scenarios cannot run here, or ``None`` when ``transformers`` is importable."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install 'unison[huggingface]' or transformers)"
    return None


def llama() -> torch.nn.Module:
    """A one-layer ``LlamaForCausalLM`` from a local config (4 heads of 4, 2 key/value heads: tensor
    parallel at 2 keeps whole heads on each rank); tensor parallel applies its own (Hugging Face's) plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    return total, (labels != IGNORE_INDEX).sum()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair form: the slice's summed next-token cross entropy and its count of valid labels."""
    return _summed_cross_entropy(logits, labels)


def token_slice_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same loss as the slice's own token mean (a scalar): what re-weights tokens by the split."""
    total, items = _summed_cross_entropy(logits, labels)
    return total / items.clamp(min=1)


def huggingface_slice_mean(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Hugging Face model's own loss as ``training_step`` returns it by hand: its slice's token mean."""
    return model(**batch).loss


__all__ = [
    "IGNORE_INDEX",
    "LENGTH",
    "VOCAB",
    "TokenDicts",
    "TokenLM",
    "huggingface_slice_mean",
    "llama",
    "token_loss",
    "token_pairs",
    "token_slice_mean",
    "transformers_missing",
]

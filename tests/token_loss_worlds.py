"""Token-weighted losses on padded, variable-length causal-LM batches (importable by spawned ranks).

Two models, both tiny: a Hugging Face Llama built from a local config (dict
batches, its own loss, a tensor-parallel plan of its own) for the data-parallel
strategies, and an ``nn.Sequential`` language model for pipelines (the
``loss_fn`` form). Every sequence has a valid length of 2..24 of 24 positions,
the rest padding with label -100, so a mean per micro-batch slice re-weights
tokens by how the global batch is split. :func:`reference` is the hand-written
full-batch loop the trainer must match: the step's summed per-token loss over
its valid-token count.
"""

from __future__ import annotations

from typing import Any

import torch

import unison

VOCAB, LENGTH, STEPS, GLOBAL_BATCH, LR = 64, 24, 6, 16, 1e-3


def lm_samples(n: int = STEPS * GLOBAL_BATCH, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` dict samples: ``input_ids`` padded with 0, ``attention_mask``, ``labels`` -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(2, LENGTH + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        mask = (torch.arange(LENGTH) < length).long()
        samples.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return samples


def pair_samples(n: int = STEPS * GLOBAL_BATCH, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same sequences as ``(input_ids, next-token labels)`` pairs for the ``loss_fn`` form (pipelines)."""
    out = []
    for s in lm_samples(n, seed):
        labels = torch.cat([s["labels"][1:], torch.tensor([-100])])
        out.append((s["input_ids"], labels))
    return out


def llama() -> torch.nn.Module:
    """A 2-layer Llama with a vocabulary of 64 (seeded by the trainer when given as a factory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


class SequentialLM(torch.nn.Sequential):
    """Embedding -> two residual-free MLP blocks -> vocabulary head: cut into stages by a pipeline."""

    def __init__(self) -> None:
        d = 32
        super().__init__(
            torch.nn.Embedding(VOCAB, d),
            torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(), torch.nn.Linear(64, d)),
            torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(), torch.nn.Linear(64, d)),
            torch.nn.Linear(d, VOCAB),
        )


def sequential_lm() -> torch.nn.Module:
    return SequentialLM()


def token_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair form through ``loss_fn``: summed next-token cross entropy and the valid-label count."""
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=-100
    )
    return total, (labels != -100).sum()


def token_training_step(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair form through ``training_step``, computed from the logits by hand."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_loss_fn(logits[:, :-1], batch["labels"][:, 1:])


def mean_training_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each micro-batch's own token mean: what re-weights tokens by the split."""
    return model(**batch).loss


FORMS = {"pair": {"training_step": token_training_step}, "hf": {}, "mean": {"training_step": mean_training_step}}


def fit(strategy: str, form: str, accumulate: int = 1, **options: Any) -> dict[str, Any]:
    """Train one configuration; the canonical state, the logged losses and grad norms."""
    pipeline = form == "pair_loss_fn"
    trainer = unison.Trainer(
        strategy=strategy,
        strategy_options=options or None,
        global_batch_size=GLOBAL_BATCH,
        accumulate_grad_batches=accumulate,
        max_steps=STEPS,
        shuffle=False,
        seed=0,
        loggers=False,
        progress="off",
    )
    if pipeline:
        trainer.fit(
            sequential_lm, pair_samples(), loss_fn=token_loss_fn, optimizer=lambda p: torch.optim.AdamW(p, lr=LR)
        )
    else:
        trainer.fit(llama, lm_samples(), optimizer=lambda p: torch.optim.AdamW(p, lr=LR), **FORMS[form])
    history = trainer.progress.history
    return {
        "state": trainer.full_state_dict(),
        "losses": [h.loss for h in history],
        "grad_norms": [h.grad_norm for h in history],
        "items": [h.num_items for h in history],
        "tokens": [h.tokens for h in history],
    }


def token_world(cases: list[tuple[str, str, int, dict[str, Any]]]) -> dict[str, Any]:
    """Every ``(strategy, form, accumulation, options)`` case in one world, keyed ``strategy/form/accumulation``."""
    return {f"{s}/{form}/{acc}": fit(s, form, acc, **opts) for s, form, acc, opts in cases}


def reference(pipeline: bool = False) -> dict[str, Any]:
    """The hand-written full-batch loop: per step, the summed token loss over the global batch / its valid tokens."""
    torch.manual_seed(0)  # what the trainer's seed=0 does before calling the factory
    model = sequential_lm() if pipeline else llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    samples = pair_samples() if pipeline else lm_samples()
    losses, norms = [], []
    for k in range(STEPS):
        chunk = samples[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        if pipeline:
            inputs, labels = torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])
            total, items = token_loss_fn(model(inputs), labels)
        else:
            batch = {key: torch.stack([s[key] for s in chunk]) for key in chunk[0]}
            total, items = token_training_step(model, batch)
        loss = total / items
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        optimizer.step()
        losses.append(float(loss))
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "grad_norms": norms,
    }


def max_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest absolute parameter difference (every key of the reference)."""
    return max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)

"""Trainer settings: the ``[trainer]`` table of a config file, and what every strategy receives.

This module sits below the strategy contract: it imports nothing of unison's
but the errors, so strategies, the registry and the trainer can all import it
without an import circle.

Types are strict: ``global_batch_size=True`` or ``shuffle="yes"`` is refused,
never coerced (pydantic's strict mode; an int is still a valid float).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from unison.errors import ConfigurationError, did_you_mean


class TrainerSettings(pydantic.BaseModel):
    """Everything that configures a Trainer; the ``[trainer]`` table of a config file."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)

    strategy: str = "single"
    """Registered strategy name (``unison strategies`` lists them)."""
    nproc: int | None = pydantic.Field(None, ge=1)
    """Processes on this node: ``python train.py`` then starts them itself (docs/launch.md); ``None``: as launched."""
    strategy_options: dict[str, Any] = {}
    """Options of that strategy, validated by its own schema."""
    precision: str = "32-true"
    """``32-true`` | ``bf16-mixed`` | ``bf16-true`` | ``16-mixed`` | a plugin's name."""
    accumulate_grad_batches: int = pydantic.Field(1, ge=1)
    """Micro-batches per optimizer step."""
    global_batch_size: int = pydantic.Field(32, ge=1)
    """Samples per optimizer step, all ranks together."""
    max_steps: int | None = pydantic.Field(None, ge=1)
    """Optimizer steps to train for (skipped fp16 steps count); set this or ``max_epochs``."""
    max_epochs: int | None = pydantic.Field(None, ge=1)
    """Passes over the training data to train for; set this or ``max_steps``."""
    grad_clip_norm: float | None = pydantic.Field(None, gt=0)
    """Clip by the global L2 norm over all shards; ``None`` only measures it."""
    seed: int = 0
    """Seeds model construction (when ``fit`` gets a factory), data order and every RNG."""
    shuffle: bool = True
    """Shuffle map-style data once per epoch (by seed and epoch, never by rank)."""
    log_every_n_steps: int = pydantic.Field(1, ge=1)
    """How often metrics go to loggers."""
    val_every_n_steps: int | None = pydantic.Field(None, ge=1)
    """Validate every N steps; with a val_dataset, always once at the end."""
    val_batch_size: int = pydantic.Field(32, ge=1)
    """Validation samples per rank per forward."""
    root_dir: str | None = None
    """Runs' home: each fit writes into a new ``root_dir/version_N`` (checkpoints and metrics)."""
    checkpoint_dir: str | None = None
    """Exactly where checkpoints go; ``None``: ``root_dir/version_N/checkpoints`` with a root_dir, else none."""
    checkpoint_every_n_steps: int | None = pydantic.Field(None, ge=1)
    """Save every N steps (and always at the end when checkpoint_dir is set)."""
    keep_last_n_checkpoints: int | None = pydantic.Field(None, ge=1)
    """Delete older committed checkpoints beyond this many."""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """Device kind; ``auto`` takes CUDA when available."""
    num_workers: int = pydantic.Field(0, ge=0)
    """DataLoader worker processes per rank (0: load in the training process)."""
    pin_memory: bool = False
    """Pin host batches so copies to the GPU are asynchronous."""
    prefetch_factor: int | None = pydantic.Field(None, ge=1)
    """Micro-batches each worker loads ahead (needs ``num_workers > 0``)."""
    persistent_workers: bool = False
    """Keep workers alive between epochs (needs ``num_workers > 0``)."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Progress display on rank 0: ``auto`` draws a live bar in a terminal and prints plain lines otherwise."""
    progress_every_n_steps: int | None = pydantic.Field(None, ge=1)
    """Steps between plain progress lines; ``None`` prints about 20 lines per run."""
    log_format: Literal["text", "json"] | None = None
    """unison's messages as ``text`` or ``json`` (one object per line); ``None``: ``UNISON_LOG_FORMAT``, else text."""
    throughput: bool = True
    """Log step time, samples/s, tokens/s and peak memory on logging steps (the default Throughput callback)."""
    nonfinite: Literal["raise", "skip", "continue"] = "raise"
    """A non-finite loss or grad norm (without loss scaling): ``raise`` stops every rank before the optimizer
    step, ``skip`` skips the step, ``continue`` does not check."""
    max_consecutive_skips: int = pydantic.Field(25, ge=1)
    """Skipped steps in a row (fp16 overflows, or ``nonfinite="skip"``) after which training stops."""
    stall_timeout_s: float | None = pydantic.Field(300.0, ge=1)
    """Seconds a rank's heartbeat may stop before every live rank names it and exits with code 3; None: no watchdog."""
    compile: bool | dict[str, Any] = False
    """``torch.compile`` the model's forward (per block under ``fsdp``): ``True`` with torch's defaults (inductor),
    or a table of ``torch.compile`` keyword arguments (``{mode = "max-autotune"}``); refused by strategies that
    declare it."""
    activation_checkpointing: str | None = None
    """Recompute the model's blocks in backward instead of keeping their activations: ``"full"`` (every block)
    or ``"selective:N"`` (every N-th block); blocks as :func:`unison.contract.transforms.model_blocks` finds them."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if (self.max_steps is None) == (self.max_epochs is None):
            given = "both" if self.max_steps is not None else "neither"
            raise ValueError(
                f"set exactly one of max_steps and max_epochs ({given} given): max_steps counts optimizer "
                "steps, max_epochs passes over the training data"
            )
        if self.num_workers == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            raise ValueError("prefetch_factor and persistent_workers need num_workers > 0")
        return self

    @pydantic.field_validator("activation_checkpointing")
    @classmethod
    def _check_policy(cls, policy: str | None) -> str | None:
        if policy is not None:
            checkpoint_every(policy)  # a ValueError names the valid policies
        return policy

    def micro_batch_size(self, data_parallel_size: int) -> int:
        """Samples per micro-batch on one data-parallel replica (sizes are checked to divide)."""
        return self.global_batch_size // self.accumulate_grad_batches // data_parallel_size


def checkpoint_every(policy: str) -> int:
    """Every how many blocks ``policy`` checkpoints: ``"full"`` -> 1, ``"selective:N"`` -> N."""
    if policy == "full":
        return 1
    name, _, n = policy.partition(":")
    if name == "selective" and n.isdigit() and int(n) >= 1:
        return int(n)
    raise ValueError(
        f'activation_checkpointing={policy!r} is not a policy: use "full" (every block) or "selective:N" '
        "(every N-th block, N >= 1)"
    )


def parse_settings(settings: dict[str, Any]) -> TrainerSettings:
    """Validate ``settings`` into :class:`TrainerSettings`.

    Every bad value is reported in one :class:`ConfigurationError` naming the
    first option; an unknown option gets the closest valid name.
    """
    try:
        return TrainerSettings(**settings)
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            option = ".".join(str(p) for p in err["loc"]) or "settings"
            if err["type"] == "extra_forbidden":
                hint = did_you_mean(option, TrainerSettings.model_fields)
                problems.append((option, f"unknown option{hint}", "remove or rename it"))
                continue
            msg = err["msg"].removeprefix("Value error, ")
            problems.append((option, f"{msg} (got {err.get('input')!r})" if err["loc"] else msg, _FIX))
        option, problem, fix = problems[0]
        more = "".join(f"; {o}: {p}. Fix: {f}" for o, p, f in problems[1:])
        raise ConfigurationError(option, problem, fix + more) from None


_FIX = "see unison.TrainerSettings for the valid values and types"

"""The DeepSpeed config, generated from unison's settings and merged with the user's: plain functions.

One source of truth
-------------------
unison generates the DeepSpeed config from its own settings::

    train_batch_size               = global_batch_size
    train_micro_batch_size_per_gpu = global_batch_size / accumulate_grad_batches / world size
    gradient_accumulation_steps    = accumulate_grad_batches
    gradient_clipping              = grad_clip_norm (0.0 = off), or 0.0 where the trainer clips
    zero_optimization.compute_grad_norm = false where the trainer clips (see below)
    bf16.enabled / fp16.enabled    = precision
    zero_optimization.stage        = 1 | 2 | 3 (the strategy name)
    zero_optimization.offload_*    = strategy_options.offload_optimizer / offload_param

``strategy_options.config`` is merged on top; a key that contradicts one of
these is a :class:`~unison.errors.ConfigurationError` naming both, and an
``optimizer`` or ``scheduler`` section is refused: the optimizer is always the
client optimizer built by the trainer's factory (DeepSpeed silently lets a
config section and a client optimizer change the trajectory together), and the
LR scheduler is the trainer's, stepped once per optimizer step.

Who clips
---------
The trainer measures the global gradient norm before the optimizer step on every backend (the
``unison_on_before_optimizer_step`` hook and the non-finite check receive it). Where DeepSpeed can be
told not to measure it again (ZeRO stage 1 or 2 without optimizer offload, outside fp16, and not stage 1
under bf16-mixed, which DeepSpeed runs on its BF16 optimizer: :func:`trainer_clips`), the trainer also
clips: the generated config turns DeepSpeed's clipping and norm off (``gradient_clipping = 0.0``,
``zero_optimization.compute_grad_norm = false``) and the strategy scales the engine's gradient pieces by
``min(1, grad_clip_norm / (norm + 1e-6))``, ``torch.nn.utils.clip_grad_norm_``'s factor. Elsewhere
DeepSpeed clips at ``gradient_clipping = grad_clip_norm`` inside its step, after measuring the norm again.

Nothing here imports DeepSpeed or touches a process group: every check runs
before any process group starts, and the functions are unit-tested alone.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import pydantic

from unison.contract.settings import TrainerSettings
from unison.errors import ConfigurationError

#: Why 16-mixed is refused on CPU, in DeepSpeed's own words.
FP16_ON_CPU = (
    "DeepSpeed refuses fp16 on CPU: 'Type fp16 is not supported on your device' (its CPU accelerator "
    "reports no fp16 support)"
)

#: DeepSpeed config sections unison refuses, and why.
FORBIDDEN_SECTIONS = {
    "optimizer": "the optimizer is the client optimizer built by Trainer.fit(optimizer=...); "
    "DeepSpeed would use both and silently change the trajectory",
    "scheduler": "the LR scheduler is Trainer.fit(lr_scheduler=...), stepped by the trainer once per optimizer step",
}

#: Overridable defaults: not unison settings, so the user may change them.
DEFAULTS: dict[str, Any] = {
    # DeepSpeed prints every N steps; unison's loggers report instead.
    "steps_per_print": 2**31 - 1,
    "wall_clock_breakdown": False,
    # unison always passes the client optimizer; with offload DeepSpeed
    # would otherwise refuse any optimizer but its own CPU Adam.
    "zero_force_ds_cpu_optimizer": False,
    # DeepSpeed lists a few optimizers as "tested" with ZeRO and refuses
    # others (torch SGD included). ZeRO steps the client optimizer over
    # flat fp32 partitions, which is right for any elementwise optimizer;
    # the conformance suite, not that list, is what certifies a run.
    "zero_allow_untested_optimizer": True,
}

#: Keys unison derives even where absent from a run's generated config: an
#: offload device in the user config must not bypass the option.
_ALWAYS_OWNED = {
    ("zero_optimization", "offload_optimizer", "device"),
    ("zero_optimization", "offload_param", "device"),
}


class DeepSpeedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep the fp32 master weights and optimizer state in CPU memory (ZeRO-Offload)."""
    offload_param: Literal["none", "cpu"] = "none"
    """Keep partitioned parameters in CPU memory (ZeRO-Infinity; ZeRO-3 only)."""
    config: dict[str, Any] = {}
    """Extra DeepSpeed config merged over the generated one; may not contradict unison settings."""


def check_options(stage: int, options: DeepSpeedOptions) -> None:
    """Refuse options that cannot work for ZeRO ``stage``, whatever the settings."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    # offload_param needs partitioned parameters.
    if options.offload_param != "none" and stage != 3:
        raise ConfigurationError(
            "strategy_options.offload_param",
            f"offload_param={options.offload_param!r} offloads partitioned parameters, which only ZeRO "
            f"stage 3 has (this is stage {stage})",
            "use strategy='zero3', or drop offload_param (offload_optimizer works on every stage)",
        )
    for section, why in FORBIDDEN_SECTIONS.items():
        if section in options.config:
            raise ConfigurationError(
                f"strategy_options.config[{section!r}]",
                f"a DeepSpeed {section!r} section is not accepted: {why}",
                f"remove the {section!r} section; pass optimizer=/lr_scheduler= to Trainer.fit instead",
            )


def trainer_clips(stage: int, options: DeepSpeedOptions, settings: TrainerSettings) -> bool:
    """Whether the trainer clips and DeepSpeed measures no norm of its own (see the module's docstring).

    DeepSpeed 0.19 skips its norm only in the ZeRO stage 1/2 optimizer (``compute_grad_norm``), and
    refuses it with optimizer offload and with stage 1's BF16 optimizer; under fp16 its norm also decides
    loss-scale overflow, so it is kept there.
    """
    return (
        settings.grad_clip_norm is not None
        and stage in (1, 2)
        and options.offload_optimizer == "none"
        and settings.precision != "16-mixed"
        and not (stage == 1 and settings.precision == "bf16-mixed")
    )


def generated_config(
    stage: int, options: DeepSpeedOptions, settings: TrainerSettings, world_size: int
) -> dict[str, Any]:
    """The DeepSpeed config unison derives from its own settings (before the user's merge)."""
    s = settings
    zero: dict[str, Any] = {"stage": stage}
    if options.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": options.offload_optimizer}
    if options.offload_param != "none":
        zero["offload_param"] = {"device": options.offload_param}
    clips = trainer_clips(stage, options, settings)
    if clips:
        zero["compute_grad_norm"] = False  # the trainer's norm is the one clipped with and reported
    return {
        "train_batch_size": s.global_batch_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size(world_size),
        "gradient_accumulation_steps": s.accumulate_grad_batches,
        # 0.0 is DeepSpeed's "no clipping" (its norm is still measured unless compute_grad_norm is off).
        "gradient_clipping": 0.0 if clips else float(s.grad_clip_norm or 0.0),
        "bf16": {"enabled": s.precision == "bf16-mixed"},
        "fp16": {"enabled": s.precision == "16-mixed"},
        "zero_optimization": zero,
    }


def _unison_source(
    path: tuple[str, ...], stage: int, options: DeepSpeedOptions, settings: TrainerSettings, world_size: int, name: str
) -> str:
    """Which unison setting produced a generated key, as the user would write it."""
    s = settings
    return {
        ("train_batch_size",): f"global_batch_size={s.global_batch_size}",
        ("train_micro_batch_size_per_gpu",): f"global_batch_size={s.global_batch_size} / "
        f"accumulate_grad_batches={s.accumulate_grad_batches} / world size {world_size}",
        ("gradient_accumulation_steps",): f"accumulate_grad_batches={s.accumulate_grad_batches}",
        ("gradient_clipping",): f"grad_clip_norm={s.grad_clip_norm}"
        + (" (the trainer clips; DeepSpeed's clipping stays off)" if trainer_clips(stage, options, s) else ""),
        ("zero_optimization", "compute_grad_norm"): f"grad_clip_norm={s.grad_clip_norm} (the trainer measures "
        "and clips the global norm; DeepSpeed measures none)",
        ("bf16", "enabled"): f"precision={s.precision!r}",
        ("fp16", "enabled"): f"precision={s.precision!r}",
        ("zero_optimization", "stage"): f"strategy={name!r} (ZeRO stage {stage})",
        ("zero_optimization", "offload_optimizer", "device"): (
            f"strategy_options.offload_optimizer={options.offload_optimizer!r}"
        ),
        ("zero_optimization", "offload_param", "device"): f"strategy_options.offload_param={options.offload_param!r}",
    }.get(path, "unison's settings")


def build_config(
    stage: int, options: DeepSpeedOptions, settings: TrainerSettings, world_size: int, *, name: str
) -> dict[str, Any]:
    """The final DeepSpeed config; raises on a user key that contradicts a unison setting.

    ``name`` is the strategy name the user asked for (named in the error).
    """
    generated = generated_config(stage, options, settings, world_size)
    gen_flat = flatten(generated)
    owned = set(gen_flat) | _ALWAYS_OWNED
    for path, value in flatten(options.config).items():
        if path in owned:
            expected = gen_flat.get(path, "none")
            if value != expected:
                source = _unison_source(path, stage, options, settings, world_size, name)
                raise ConfigurationError(
                    config_key(path),
                    f"{config_key(path)}={value!r} conflicts with {source} (which sets it to {expected!r})",
                    f"remove {path[-1]!r} from strategy_options.config: unison sets it from {source.split('=')[0]}",
                )
        elif any(k[: len(path)] == path for k in owned) or any(path[:n] in owned for n in range(1, len(path))):
            # A scalar where unison generates a section, or a section where
            # it generates a scalar: either would silently override it.
            raise ConfigurationError(
                config_key(path),
                f"{config_key(path)}={value!r} replaces a section unison generates",
                "set the individual keys instead (they may not contradict unison's settings)",
            )
    return merge(merge(DEFAULTS, generated), options.config)


def flatten(config: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{"a": {"b": 1}}`` -> ``{("a", "b"): 1}`` (an empty dict is a leaf)."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, (*prefix, key)))
        else:
            path = (*prefix, key)
            out[path] = value
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` deep-merged over a copy of ``base`` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_key(path: tuple[str, ...]) -> str:
    """How the user writes a config path: ``strategy_options.config['a']['b']``."""
    return "strategy_options.config" + "".join(f"[{p!r}]" for p in path)


__all__ = [
    "DEFAULTS",
    "FORBIDDEN_SECTIONS",
    "FP16_ON_CPU",
    "DeepSpeedOptions",
    "build_config",
    "check_options",
    "config_key",
    "flatten",
    "generated_config",
    "merge",
    "trainer_clips",
]

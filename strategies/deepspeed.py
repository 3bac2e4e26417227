"""``zero1``, ``zero2``, ``zero3``: DeepSpeed ZeRO stages 1, 2 and 3.

Three :class:`StrategySpec` values sharing one class and one option schema:
the names differ only in ``zero_optimization.stage``, which the name fixes. A
``stage`` option (or aliases with a stage preset) would let
``strategy="zero1", strategy_options={"stage": 3}`` say two things at once.

One source of truth
-------------------
unison generates the DeepSpeed config from its own settings::

    train_batch_size               = global_batch_size
    train_micro_batch_size_per_gpu = global_batch_size / accumulate_grad_batches / world size
    gradient_accumulation_steps    = accumulate_grad_batches
    gradient_clipping              = grad_clip_norm (0.0 = off)
    bf16.enabled / fp16.enabled    = precision
    zero_optimization.stage        = 1 | 2 | 3 (the strategy name)
    zero_optimization.offload_*    = strategy_options.offload_optimizer / offload_param

``strategy_options.config`` is merged on top; a key that contradicts one of
these is a :class:`~unison.errors.ConfigurationError` naming both, and an
``optimizer`` or ``scheduler`` section is refused: the optimizer is always the
client optimizer built by the trainer's factory (DeepSpeed silently lets a
config section and a client optimizer change the trajectory together), and the
LR scheduler is the trainer's, stepped once per optimizer step.

Accumulation is owned by the engine
-----------------------------------
DeepSpeed must see ``engine.backward`` and ``engine.step`` on every micro-step:
it divides each loss by ``gradient_accumulation_steps`` itself, counts
micro-steps, and reduces and updates only at its boundary. So
:meth:`DeepSpeedStrategy.backward` runs ``engine.backward(loss)`` on the
undivided loss and, on non-boundary micro-steps, ``engine.step()`` (which only
advances the counter); :meth:`~DeepSpeedStrategy.optimizer_step` runs the
boundary ``engine.step()``, which clips (``gradient_clipping``), updates and
zeroes the gradients. The loss is scaled exactly once, by the engine.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import torch

from unison.errors import ConfigurationError
from unison.ownership import (
    AccumulationOwner,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
)
from unison.plugin import hookimpl
from unison.precision import cast_floating
from unison.registry import StrategySpec, missing_modules
from unison.strategy import DistEnv, OptimizerFactory, Strategy

if TYPE_CHECKING:  # pragma: no cover
    from unison.trainer import TrainerSettings

#: The tag every checkpoint is written under: unison's own checkpointer names
#: and commits the step directory, so DeepSpeed's ``latest`` pointer is unused.
CHECKPOINT_TAG = "state"

#: Measured bf16-mixed deviation (see the ``bf16-mixed`` declaration): DeepSpeed
#: computes forward and backward with bf16 weights and bf16 gradients, the
#: reference (torch.autocast) keeps fp32 weights and gradients, so the two
#: drift apart by bf16 round-off accumulated over the run.
BF16_TOLERANCE = 5e-2

#: DeepSpeed config sections unison refuses, and why.
FORBIDDEN_SECTIONS = {
    "optimizer": "the optimizer is the client optimizer built by Trainer.fit(optimizer=...); "
    "DeepSpeed would use both and silently change the trajectory",
    "scheduler": "the LR scheduler is Trainer.fit(lr_scheduler=...), stepped by the trainer once per optimizer step",
}


class DeepSpeedOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep the fp32 master weights and optimizer state in CPU memory (ZeRO-Offload)."""
    offload_param: Literal["none", "cpu"] = "none"
    """Keep partitioned parameters in CPU memory (ZeRO-Infinity; ZeRO-3 only)."""
    config: dict[str, Any] = {}
    """Extra DeepSpeed config merged over the generated one; may not contradict unison settings."""


def _deepspeed(device: torch.device | None = None) -> Any:
    """Import DeepSpeed, choosing its CPU accelerator on a CPU device.

    DeepSpeed picks its accelerator once, at first import, from
    ``DS_ACCELERATOR`` or by probing; a CPU run must therefore say ``cpu``
    before that import. An accelerator that disagrees with the device unison
    chose is an error, not a silent fallback.
    """
    if device is not None and device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if device is not None and get_accelerator().device_name() != device.type:
        raise RuntimeError(
            f"DeepSpeed's accelerator is {get_accelerator().device_name()!r} but unison trains on {device.type!r}; "
            f"set DS_ACCELERATOR={device.type} before deepspeed is first imported"
        )
    return deepspeed


def _resolve_device_type(settings: "TrainerSettings") -> str:
    if settings.accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return settings.accelerator


def _flatten(config: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _config_key(path: tuple[str, ...]) -> str:
    return "strategy_options.config" + "".join(f"[{p!r}]" for p in path)


class DeepSpeedStrategy(Strategy):
    """A DeepSpeed engine around the user's module with the client optimizer."""

    def __init__(self, stage: int, **options: Any) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
        self.stage = stage
        self.options = DeepSpeedOptions(**options)
        # Refused at construction: offload_param needs partitioned parameters.
        if self.options.offload_param != "none" and stage != 3:
            raise ConfigurationError(
                "strategy_options.offload_param",
                f"offload_param={self.options.offload_param!r} offloads partitioned parameters, which only ZeRO "
                f"stage 3 has (this is stage {self.stage})",
                "use strategy='zero3', or drop offload_param (offload_optimizer works on every stage)",
            )
        for section, why in FORBIDDEN_SECTIONS.items():
            if section in self.options.config:
                raise ConfigurationError(
                    f"strategy_options.config[{section!r}]",
                    f"a DeepSpeed {section!r} section is not accepted: {why}",
                    f"remove the {section!r} section; pass optimizer=/lr_scheduler= to Trainer.fit instead",
                )
        self.engine: Any = None
        self.ds_config: dict[str, Any] | None = None
        self._boundary = False

    # -- declaration ------------------------------------------------------- #
    @property
    def ownership(self) -> Ownership:
        stage = self.stage
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.ENGINE,
                "DeepSpeed gradient_accumulation_steps=accumulate_grad_batches: engine.backward divides each "
                "undivided micro-batch loss by it, engine.step() runs on every micro-step and updates only at "
                "the engine's boundary",
            ),
            precision={
                "32-true": PrecisionSupport(PrecisionOwner.ENGINE, "DeepSpeed fp32 (bf16 and fp16 disabled)"),
                "bf16-mixed": PrecisionSupport(
                    PrecisionOwner.ENGINE,
                    "DeepSpeed bf16: the engine casts the module to bfloat16 and keeps fp32 master weights and "
                    "optimizer state; inputs are cast to bfloat16 and outputs back to float32, so loss_fn sees "
                    f"float32. Measured deviation from single bf16-mixed (autocast): <= {BF16_TOLERANCE:g} max abs "
                    "parameter difference after 20 steps (bf16 weights and gradients vs autocast's fp32 ones)",
                ),
                "bf16-true": PrecisionSupport.unsupported(
                    "DeepSpeed's bf16 mode always keeps fp32 master weights and optimizer state, which is "
                    "bf16-mixed; it has no all-bfloat16 mode for ZeRO with a client optimizer"
                ),
                "16-mixed": PrecisionSupport(
                    PrecisionOwner.ENGINE,
                    "DeepSpeed fp16 with dynamic loss scaling; an overflow skips the engine's step. CUDA only: on "
                    "CPU DeepSpeed refuses it ('Type fp16 is not supported on your device')",
                ),
            },
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format=f"DeepSpeed engine.save_checkpoint(tag={CHECKPOINT_TAG!r}): mp_rank_00_model_states.pt + "
                "one zero_pp_rank_R_mp_rank_00_optim_states.pt per rank (ZeRO-partitioned optimizer state)",
                # DeepSpeed can reshard only through its offline universal
                # checkpoint conversion (ds_to_universal); unison does not run
                # it, so a checkpoint resumes at the world size that wrote it.
                reshardable=False,
                canonical_export="deepspeed.utils.safe_get_full_fp32_param per parameter on every rank (gathers "
                "ZeRO-3 partitions; the fp32 master, not the bf16 copy), buffers as held, cast to fp32 on CPU",
            ),
            notes=(
                f"ZeRO stage {stage}: "
                + {1: "optimizer state sharded", 2: "optimizer state and gradients sharded",
                   3: "optimizer state, gradients and parameters sharded"}[stage],
                "zero_grad() is a no-op: the boundary engine.step() zeroes gradients itself",
                "the LR scheduler is built on the client optimizer, whose param_groups the ZeRO optimizer updates "
                "with, so stepping it changes the lr DeepSpeed uses",
            ),
        )

    # -- validation (no process group) ---------------------------------------- #
    def generated_config(self, settings: "TrainerSettings", world_size: int) -> dict[str, Any]:
        """The DeepSpeed config unison derives from its own settings (before the user's merge)."""
        s = settings
        stage = self.stage
        zero: dict[str, Any] = {"stage": stage}
        if self.options.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": self.options.offload_optimizer}
        if self.options.offload_param != "none":
            zero["offload_param"] = {"device": self.options.offload_param}
        return {
            "train_batch_size": s.global_batch_size,
            "train_micro_batch_size_per_gpu": s.global_batch_size // s.accumulate_grad_batches // world_size,
            "gradient_accumulation_steps": s.accumulate_grad_batches,
            # 0.0 is DeepSpeed's "no clipping"; the norm is still measured.
            "gradient_clipping": float(s.grad_clip_norm or 0.0),
            "bf16": {"enabled": s.precision == "bf16-mixed"},
            "fp16": {"enabled": s.precision == "16-mixed"},
            "zero_optimization": zero,
        }

    #: Overridable defaults: not unison settings, so the user may change them.
    DEFAULTS: dict[str, Any] = {
        # DeepSpeed prints every N steps; unison's loggers report instead.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # unison always passes the client optimizer; with offload DeepSpeed
        # would otherwise refuse any optimizer but its own CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
    }

    def _unison_source(self, path: tuple[str, ...], settings: "TrainerSettings", world_size: int) -> str:
        """Which unison setting produced a generated key, as the user would write it."""
        s = settings
        return {
            ("train_batch_size",): f"global_batch_size={s.global_batch_size}",
            ("train_micro_batch_size_per_gpu",): f"global_batch_size={s.global_batch_size} / "
            f"accumulate_grad_batches={s.accumulate_grad_batches} / world size {world_size}",
            ("gradient_accumulation_steps",): f"accumulate_grad_batches={s.accumulate_grad_batches}",
            ("gradient_clipping",): f"grad_clip_norm={s.grad_clip_norm}",
            ("bf16", "enabled"): f"precision={s.precision!r}",
            ("fp16", "enabled"): f"precision={s.precision!r}",
            ("zero_optimization", "stage"): f"strategy={self.name!r} (ZeRO stage {self.stage})",
            ("zero_optimization", "offload_optimizer", "device"):
                f"strategy_options.offload_optimizer={self.options.offload_optimizer!r}",
            ("zero_optimization", "offload_param", "device"):
                f"strategy_options.offload_param={self.options.offload_param!r}",
        }.get(path, "unison's settings")

    def build_config(self, settings: "TrainerSettings", world_size: int) -> dict[str, Any]:
        """The final DeepSpeed config; raises on a user key that contradicts a unison setting."""
        generated = self.generated_config(settings, world_size)
        user = self.options.config
        gen_flat = _flatten(generated)
        # The keys unison derives, even where absent from this run's config:
        # an offload device in the user config must not bypass the option.
        owned = set(gen_flat) | {
            ("zero_optimization", "offload_optimizer", "device"),
            ("zero_optimization", "offload_param", "device"),
        }
        for path, value in _flatten(user).items():
            if path in owned:
                expected = gen_flat.get(path, "none")
                if value != expected:
                    raise ConfigurationError(
                        _config_key(path),
                        f"{_config_key(path)}={value!r} conflicts with {self._unison_source(path, settings, world_size)}"
                        f" (which sets it to {expected!r})",
                        f"remove {path[-1]!r} from strategy_options.config and set it through the unison option",
                    )
            elif any(k[: len(path)] == path for k in owned) or any(path[:n] in owned for n in range(1, len(path))):
                # A scalar where unison generates a section, or a section where
                # it generates a scalar: either would silently override it.
                raise ConfigurationError(
                    _config_key(path),
                    f"{_config_key(path)}={value!r} replaces a section unison generates",
                    "set the individual keys instead (they may not contradict unison's settings)",
                )
        return _merge(_merge(self.DEFAULTS, generated), user)

    def validate(self, settings: "TrainerSettings", world_size: int) -> None:
        s = settings
        if s.precision == "16-mixed" and _resolve_device_type(s) == "cpu":
            # Decided without importing deepspeed (seconds, and it fixes the
            # accelerator for the process); the reason is DeepSpeed's own.
            raise ConfigurationError(
                "precision",
                "DeepSpeed refuses precision '16-mixed' on CPU: 'Type fp16 is not supported on your device' "
                "(its CPU accelerator reports no fp16 support)",
                "use precision='bf16-mixed' or '32-true' on CPU, or train on CUDA",
            )
        # Also catches conflicting user keys, before any process group.
        self.build_config(s, max(world_size, 1))

    # -- setup ------------------------------------------------------------- #
    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, env: DistEnv,
              settings: "TrainerSettings") -> None:
        deepspeed = _deepspeed(env.device)
        self.ds_config = self.build_config(settings, env.world_size)
        self._dtype = torch.bfloat16 if settings.precision == "bf16-mixed" else (
            torch.float16 if settings.precision == "16-mixed" else torch.float32)
        module = module.to(env.device)
        # The fp32 weights as the user built them: DeepSpeed casts the module to
        # bf16/fp16 before it creates the fp32 master copy, which would start
        # the masters from rounded values; they are restored below.
        exact = {n: p.detach().clone() for n, p in module.named_parameters()} if self._dtype != torch.float32 else {}
        optimizer = make_optimizer(module.parameters())
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=self.ds_config)
        if exact:
            from deepspeed.utils import safe_set_full_fp32_param

            for name, param in module.named_parameters():
                if param.requires_grad:
                    safe_set_full_fp32_param(param, exact[name].to(torch.float32))
        self.module = module
        self.model = self.engine
        # The client optimizer: the ZeRO optimizer steps it over its flat
        # partitions and shares its param_groups dicts, so a scheduler built
        # on it changes the lr the engine applies, and lrs read from it are
        # the lrs used.
        self.optimizer = optimizer
        self._boundary = False

    # -- hot path ----------------------------------------------------------- #
    def forward(self, inputs: Any) -> Any:
        if self._dtype != torch.float32:
            # The engine's weights are bf16/fp16; inputs must match. Outputs go
            # back to fp32 so that loss_fn runs in fp32, as under autocast.
            return cast_floating(self.model(cast_floating(inputs, self._dtype)), torch.float32)
        return self.model(inputs)

    def backward(self, loss: torch.Tensor) -> None:
        # Read before step(): step() advances the engine's micro-step counter.
        self._boundary = bool(self.engine.is_gradient_accumulation_boundary())
        self.engine.backward(loss)
        if not self._boundary:
            # DeepSpeed requires step() on every micro-step; off the boundary
            # it only counts the micro-step.
            self.engine.step()

    def is_accumulation_boundary(self) -> bool:
        return self._boundary

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Measure the global pre-clip norm; the engine clips inside the boundary ``step()``.

        ``gradient_clipping`` in the generated config is ``grad_clip_norm``, so
        ``max_norm`` must be that value (the engine cannot clip to another).
        """
        configured = float(self.ds_config["gradient_clipping"]) if self.ds_config else 0.0
        if float(max_norm or 0.0) != configured:
            raise RuntimeError(
                f"clip_grad_norm({max_norm}) but the engine clips at gradient_clipping={configured}; "
                "DeepSpeed clips inside engine.step() at its configured value only"
            )
        return self._global_grad_norm()

    def _global_grad_norm(self) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_grad

        total = torch.zeros((), dtype=torch.float64, device=self.env.device if self.env else "cpu")
        for param in self.module.parameters():
            if not param.requires_grad:
                continue
            grad = safe_get_full_grad(param)
            if grad is not None:
                total += grad.detach().double().pow(2).sum()
        return total.sqrt().float().cpu()

    def optimizer_step(self) -> bool:
        self.engine.step()
        # Off only when the engine skipped (fp16 overflow) at its boundary.
        return not self.engine.was_step_applied()

    def zero_grad(self) -> None:
        # The boundary engine.step() already zeroed the gradients.
        pass

    # -- state -------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        deepspeed = _deepspeed()
        out: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter):
                key = id(value)
                if key not in gathered:  # tied weights: gather once
                    full = safe_get_full_fp32_param(value)
                    if full is None:
                        # Not trained by the optimizer (frozen): gather the
                        # ZeRO-3 partition or read the replicated tensor.
                        with deepspeed.zero.GatheredParameters([value], enabled=hasattr(value, "ds_id")):
                            full = value.data.detach().clone()
                    gathered[key] = full
                value = gathered[key]
            out[name] = value.detach().float().cpu().clone() if value.is_floating_point() else value.detach().cpu().clone()
        return out

    def save_state(self, directory: Path) -> None:
        # save_latest=False: the tag is fixed and unison's checkpointer commits.
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, directory: Path) -> None:
        # The LR schedule is the trainer's (restored from trainer.pt); the
        # engine has none of its own to restore.
        load_path, _ = self.engine.load_checkpoint(
            str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {CHECKPOINT_TAG!r} under {directory}")

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state.

        * parameters: the module's parameters; under ZeRO-3 only this rank's
          partition (``ds_tensor``), except parameters DeepSpeed keeps whole
          (``ds_persist``, below ``stage3_param_persistence_threshold``).
        * gradients: stage 1 keeps whole gradients in ``param.grad`` across the
          accumulation window; stages 2 and 3 reduce-scatter at every micro-step
          and keep only this rank's partition.
        * optimizer_state: the fp32 master partition DeepSpeed keeps (a copy
          even in fp32 training) plus the client optimizer's state tensors,
          which are allocated over that partition.
        """
        assert self.module is not None and self.engine is not None
        zero = self.engine.optimizer
        stage = self.stage
        params = grads = 0
        for p in self.module.parameters():
            if stage == 3 and hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False):
                held = p.ds_tensor.numel()
            else:
                held = p.numel()
            params += held * p.element_size()
        masters = zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups
        master_bytes = sum(t.numel() * t.element_size() for t in masters)
        if stage == 1:
            grads = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
        else:
            # Gradient partitions are held in the parameters' dtype.
            elem = next(self.module.parameters()).element_size()
            grads = sum(t.numel() for t in masters) * elem
        state = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return {"parameters": params, "gradients": grads, "optimizer_state": master_bytes + state}

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None
        self.model = self.optimizer = None


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    unavailable = missing_modules("deepspeed")
    sharded = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}
    return [
        StrategySpec(
            name=f"zero{stage}",
            factory=functools.partial(DeepSpeedStrategy, stage),
            description=f"DeepSpeed ZeRO-{stage} ({sharded[stage]} sharded); engine-owned accumulation and "
            "precision, client optimizer, DeepSpeed checkpoints",
            options=DeepSpeedOptions,
            unavailable=unavailable,
        )
        for stage in (1, 2, 3)
    ]

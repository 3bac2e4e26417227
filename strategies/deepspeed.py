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

The grad norm unison reports is measured before that step from the full
gradients (``deepspeed.utils.safe_get_full_grad``, collective under ZeRO-2/3);
it equals the reference's and the one the engine then clips with
(``engine.get_global_grad_norm()``).

Checkpoints
-----------
Each checkpoint holds DeepSpeed's own files (``engine.save_checkpoint``, used
to resume by the same stage, world size and precision) and, beside them, the
canonical torch.distributed.checkpoint copy every torch strategy writes, from
which any other backend, stage or world size resumes (and which this strategy
reads when it did not write the DeepSpeed files itself). Writing that copy
gathers the full model and optimizer state on every rank's CPU for a moment.

After ``fit`` under ZeRO-3 the module's parameters are DeepSpeed's partitioned
placeholders; ``Trainer.full_state_dict()`` is the way to the weights.
"""

from __future__ import annotations

import copy
import functools
import json
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
from unison.state import dcp_load, dcp_save
from unison.env import resolve_accelerator
from unison.settings import TrainerSettings
from unison.strategy import OptimizerFactory, Strategy


#: The tag every checkpoint is written under: unison's own checkpointer names
#: and commits the step directory, so DeepSpeed's ``latest`` pointer is unused.
CHECKPOINT_TAG = "state"
#: Written beside the checkpoint: which engine wrote DeepSpeed's own files.
NATIVE_META = "deepspeed.json"

#: Ceiling on the max abs parameter difference from single's bf16-mixed after
#: 20 steps (accumulation 4, clipping, AdamW, StepLR), about 4x the measured
#: 1.2e-3 (zero1) and 4.5e-4 (zero2, zero3). DeepSpeed computes forward and
#: backward with bf16 weights and bf16 gradients where the reference
#: (torch.autocast) keeps fp32 weights and gradients; for scale, bf16-mixed
#: itself moves 1.9e-2 away from the fp32 trajectory on the same run.
BF16_TOLERANCE = 5e-3

#: Why 16-mixed is refused on CPU, in DeepSpeed's own words.
FP16_ON_CPU = ("DeepSpeed refuses fp16 on CPU: 'Type fp16 is not supported on your device' (its CPU accelerator "
               "reports no fp16 support)")

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


def _meta_skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no data copied).

    Tied parameters stay tied: the deepcopy memo maps each tensor once.
    """
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (
                torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter) else empty
            )
    return copy.deepcopy(module, memo)


def _restore_fp32_masters(module: torch.nn.Module, exact: dict[str, torch.Tensor]) -> None:
    """Set each parameter's fp32 master (this rank's part) to its exact fp32 value.

    ZeRO-3 goes through the local-partition API: DeepSpeed's full-parameter
    setter narrows past the end of the last rank's padded partition when a
    parameter's size does not divide by the world size.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        value = exact[name].to(torch.float32)
        if hasattr(param, "ds_id"):
            group = param.ds_process_group
            rank, world = torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
            part = param.ds_tensor.numel()
            padded = torch.zeros(part * world, dtype=torch.float32, device=value.device)
            padded[: value.numel()] = value.flatten()
            safe_set_local_fp32_param(param, padded[rank * part : (rank + 1) * part])
        else:
            safe_set_full_fp32_param(param, value)


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
        self._skeleton: torch.nn.Module | None = None
        self._group_names: list[list[str]] = []
        self._deepspeed_version = ""
        self.ds_config: dict[str, Any] | None = None
        self._boundary = False
        #: The dtype of the engine's weights (set from the precision in setup).
        self._dtype = torch.float32

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
                    f"float32. Deviation from single's bf16-mixed (autocast): <= {BF16_TOLERANCE:g} max abs parameter "
                    "difference after 20 steps (measured 1.2e-3 zero1, 4.5e-4 zero2/zero3): DeepSpeed keeps bf16 "
                    "weights and gradients where autocast keeps fp32 ones",
                ),
                "bf16-true": PrecisionSupport.unsupported(
                    "DeepSpeed's bf16 mode always keeps fp32 master weights and optimizer state, which is "
                    "bf16-mixed; it has no all-bfloat16 mode for ZeRO with a client optimizer"
                ),
                # Declared for this machine, like a strategy's availability:
                # DeepSpeed's CPU accelerator has no fp16.
                "16-mixed": PrecisionSupport(
                    PrecisionOwner.ENGINE,
                    "DeepSpeed fp16 with dynamic loss scaling; an overflow skips the engine's step (CUDA only)",
                ) if torch.cuda.is_available() else PrecisionSupport.unsupported(FP16_ON_CPU),
            },
            state_dict=StateDictDeclaration(
                kind=StateDictKind.SHARDED,
                format=f"DeepSpeed engine.save_checkpoint(tag={CHECKPOINT_TAG!r}) in state/ (model states + one "
                "zero_pp_rank_R optimizer shard per rank), used to resume by the same stage, world size and "
                "precision; beside it the canonical torch.distributed.checkpoint (DCP) copy every torch strategy "
                "writes (full fp32 parameters, optimizer state keyed by parameter name), used otherwise",
                # Through the canonical copy, not DeepSpeed's universal
                # checkpoint conversion (an offline ds_to_universal step).
                reshardable=True,
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
                "DeepSpeed calls the client optimizer's step() once per parameter group (ZeRO-3: per sub-group) "
                "in each optimizer step, with param_groups narrowed to that group, so step hooks registered on "
                "that optimizer fire that many times; together they make exactly one update of every group",
                "memory (measured, 2.1M parameters, world 2, bytes of parameters + gradients + optimizer state per "
                "rank / ddp's): fp32 zero1 0.875, zero2 0.750, zero3 0.625; bf16-mixed 0.625, 0.5625, 0.500. "
                "DeepSpeed keeps a separate fp32 master partition even when the parameters are fp32 (upstream "
                "design: a second buffer, not an alias), so fp32 ZeRO-3 holds (4+4+12)/N bytes per parameter "
                "instead of the ZeRO paper's 16/N, which assumes mixed precision",
            ),
        )

    # -- validation (no process group) ---------------------------------------- #
    def generated_config(self, settings: TrainerSettings, world_size: int) -> dict[str, Any]:
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
            "train_micro_batch_size_per_gpu": s.micro_batch_size(world_size),
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
        # DeepSpeed lists a few optimizers as "tested" with ZeRO and refuses
        # others (torch SGD included). ZeRO steps the client optimizer over
        # flat fp32 partitions, which is right for any elementwise optimizer;
        # the conformance suite, not that list, is what certifies a run.
        "zero_allow_untested_optimizer": True,
    }

    def _unison_source(self, path: tuple[str, ...], settings: TrainerSettings, world_size: int) -> str:
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

    def build_config(self, settings: TrainerSettings, world_size: int) -> dict[str, Any]:
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
                        f"remove {path[-1]!r} from strategy_options.config: unison sets it from "
                        f"{self._unison_source(path, settings, world_size).split('=')[0]}",
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

    def validate(self, settings: TrainerSettings, world_size: int) -> None:
        s = settings
        if s.precision == "16-mixed" and resolve_accelerator(s.accelerator) == "cpu":
            # Decided without importing deepspeed (seconds, and it fixes the
            # accelerator for the process); the reason is DeepSpeed's own.
            raise ConfigurationError(
                "precision", FP16_ON_CPU, "use precision='bf16-mixed' or '32-true' on CPU, or train on CUDA"
            )
        # Also catches conflicting user keys, before any process group.
        self.build_config(s, max(world_size, 1))

    # -- setup ------------------------------------------------------------- #
    def setup(self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any,
              settings: TrainerSettings) -> None:
        env = self.env
        assert env is not None
        deepspeed = _deepspeed(env.device)
        self.ds_config = self.build_config(settings, env.world_size)
        self._dtype = torch.bfloat16 if precision.name == "bf16-mixed" else (
            torch.float16 if precision.name == "16-mixed" else torch.float32)
        module = module.to(env.device)
        # The fp32 weights as the user built them: DeepSpeed casts the module to
        # bf16/fp16 before it creates the fp32 master copy, which would start
        # the masters from rounded values; they are restored below.
        exact = {n: p.detach().clone() for n, p in module.named_parameters()} if self._dtype != torch.float32 else {}
        optimizer = make_optimizer(module.parameters())
        # Taken before DeepSpeed partitions or casts anything: the names of each
        # optimizer group's parameters and a data-free copy of the module, from
        # which the canonical checkpoint is written and read.
        first_name: dict[int, str] = {}
        for name, param in module.named_parameters():
            first_name.setdefault(id(param), name)
        self._group_names = [[first_name[id(p)] for p in g["params"]] for g in optimizer.param_groups if g["params"]]
        self._skeleton = _meta_skeleton(module)
        self._deepspeed_version = deepspeed.__version__
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=self.ds_config)
        if exact:
            _restore_fp32_masters(module, exact)
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
        norm = total.sqrt()
        if self._dtype == torch.float16:
            # fp16 gradients hold loss * scale; report the unscaled norm (inf
            # or nan on overflow, like the trainer's GradScaler path).
            norm = norm / float(self.engine.optimizer.loss_scale)
        return norm.float().cpu()

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
        """Write DeepSpeed's own checkpoint and the canonical DCP one beside it (collective).

        ``directory/state/``: ``engine.save_checkpoint`` (exact resume by the
        same stage at the same world size and precision). ``directory/``:
        the torch.distributed.checkpoint files every torch strategy writes
        (full fp32 parameters and optimizer state keyed by parameter name),
        so that single, ddp, FSDP or another ZeRO stage or world size resume
        from it, and ``deepspeed.json`` says which engine wrote the first.
        """
        # save_latest=False: the tag is fixed and unison's checkpointer commits.
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)
        skeleton, shadow = self._canonical_shadow(with_state=True)
        dcp_save(skeleton, shadow, directory)
        if self.env is None or self.env.rank == 0:
            (directory / NATIVE_META).write_text(json.dumps(self._native_identity()))

    def load_state(self, directory: Path) -> None:
        """Resume from DeepSpeed's own files when this engine wrote them, else from the canonical ones."""
        meta = directory / NATIVE_META
        if meta.exists() and json.loads(meta.read_text()) == self._native_identity():
            # The LR schedule is the trainer's (restored from trainer.pt); the
            # engine has none of its own to restore.
            load_path, _ = self.engine.load_checkpoint(
                str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
            )
            if load_path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {CHECKPOINT_TAG!r} under {directory}")
            return
        # Another backend, ZeRO stage, world size or precision wrote it.
        skeleton, shadow = self._canonical_shadow(with_state=False)
        dcp_load(skeleton, shadow, directory)
        self._load_canonical(skeleton, shadow)

    def _native_identity(self) -> dict[str, Any]:
        """What must match for DeepSpeed's own checkpoint files to load as they are."""
        assert self.env is not None
        return {"stage": self.stage, "world_size": self.env.world_size, "dtype": str(self._dtype),
                "deepspeed": self._deepspeed_version}

    def _canonical_shadow(self, *, with_state: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A plain CPU copy of the module and of the client optimizer, in torch's own layout.

        The copy is built from the meta-device skeleton taken before DeepSpeed
        touched the module (same names, same tied parameters), so that
        torch.distributed.checkpoint writes and reads exactly the keys a plain
        module and optimizer have. Collective when ``with_state``: ZeRO
        partitions are gathered parameter by parameter on every rank.
        """
        assert self._skeleton is not None and self.optimizer is not None
        skeleton = copy.deepcopy(self._skeleton).to_empty(device="cpu")
        names = dict(skeleton.named_parameters())
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [names[n] for n in group_names]}
            for group, group_names in zip(self.optimizer.param_groups, self._group_names)
        ]
        try:
            shadow = type(self.optimizer)(groups, **self.optimizer.defaults)
        except TypeError:  # defaults holding keys the constructor does not take
            shadow = type(self.optimizer)(groups)
        if not with_state:
            return skeleton, shadow
        targets = skeleton.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in self.full_state_dict().items():
                targets[name].copy_(tensor)
        module_params = dict(self.module.named_parameters())
        # Every flat partition holds the same state keys; one shows which
        # are elementwise (partition-shaped) and carries the scalars (step).
        flat, flat_state = next(
            ((f, self.optimizer.state[f]) for f in self._master_flats() if self.optimizer.state.get(f)), (None, {})
        )
        for group_names in self._group_names:
            for name in group_names:
                entry: dict[str, Any] = {}
                for key, value in flat_state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        if value.shape != flat.shape:
                            raise NotImplementedError(
                                f"optimizer state {key!r} is not elementwise; only elementwise optimizer state "
                                "(Adam's moments, SGD's momentum) converts to the canonical layout"
                            )
                        full = self._full_optimizer_state(module_params[name], key, flat)
                        if full is None:  # a frozen parameter given to the optimizer: no state
                            continue
                        entry[key] = full.detach().float().cpu().reshape(names[name].shape).clone()
                    else:
                        entry[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
                if any(torch.is_tensor(v) and v.dim() > 0 for v in entry.values()):
                    shadow.state[names[name]] = entry
        return skeleton, shadow

    def _full_optimizer_state(self, param: torch.nn.Parameter, key: str, flat: torch.Tensor) -> torch.Tensor | None:
        """One parameter's whole optimizer state ``key`` (collective on every rank).

        ZeRO-3 asks DeepSpeed. ZeRO-1/2 read this rank's fragment straight out
        of the client optimizer's state through the parameter's fragment
        address and sum the fragments over ranks: DeepSpeed's own getter
        reads a per-parameter view linked once, after the first step, and
        raises for a state key that view missed (measured: a tied-weight model
        on ZeRO-2), which leaves the other ranks waiting in the all-reduce.
        """
        if self.stage == 3:
            from deepspeed.utils import safe_get_full_optimizer_state

            return safe_get_full_optimizer_state(param, key)
        if not hasattr(param, "_hp_mapping"):  # not trained by the ZeRO optimizer (frozen)
            return None
        zero = self.engine.optimizer
        buffer = torch.zeros(param.numel(), dtype=torch.float32, device=flat.device)
        mapping = param._hp_mapping
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            partition = zero.single_partition_of_fp32_groups[mapping.param_group_index]
            state = self.optimizer.state[partition][key]
            buffer.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, hp.start, hp.numel))
        torch.distributed.all_reduce(buffer, group=param._dp_group)
        return buffer.view(param.shape)

    def _master_flats(self) -> list[torch.Tensor]:
        """The fp32 master partitions of this rank: the tensors the client optimizer's state is keyed by."""
        zero = self.engine.optimizer
        return list(zero.fp32_partitioned_groups_flat if self.stage == 3 else zero.single_partition_of_fp32_groups)

    @torch.no_grad()
    def _load_canonical(self, skeleton: torch.nn.Module, shadow: torch.optim.Optimizer) -> None:
        """Write full parameters, buffers and optimizer state into this rank's ZeRO partitions."""
        assert self.module is not None and self.optimizer is not None
        zero = self.engine.optimizer
        saved = dict(skeleton.named_parameters())
        for name, buffer in self.module.named_buffers():
            buffer.copy_(skeleton.get_buffer(name).to(buffer.dtype))
        # State tensors must exist to be written into: ZeRO creates them at the
        # first step. Elementwise ones start as zeros, scalars are copied.
        keys: dict[str, Any] = {}
        for state in shadow.state.values():
            keys.update(state)
        for flat in self._master_flats():
            state = self.optimizer.state[flat]
            for key, value in keys.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state.setdefault(key, torch.zeros_like(flat))
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        for name, param in self.module.named_parameters():
            value = saved[name].detach()
            state = shadow.state.get(saved[name], {})
            elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
            if hasattr(param, "ds_id"):  # ZeRO-3: this rank's padded slice
                group = param.ds_process_group
                rank, world = torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
                part = param.ds_tensor.numel()

                def local(full: torch.Tensor) -> torch.Tensor:
                    padded = torch.zeros(part * world, dtype=torch.float32)
                    padded[: full.numel()] = full.flatten().float()
                    return padded[rank * part : (rank + 1) * part].to(param.ds_tensor.device)

                param.ds_tensor.data.copy_(local(value).to(param.ds_tensor.dtype))
                if param.requires_grad:
                    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

                    safe_set_local_fp32_param(param, local(value))
                    for key, tensor in elementwise.items():
                        safe_set_local_optimizer_state(param, local(tensor), key)
            else:  # ZeRO-1/2: whole parameters, fp32 master fragment on this rank
                param.data.copy_(value.to(param.device, param.dtype))
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is None:
                    continue
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                flat = zero.single_partition_of_fp32_groups[mapping.param_group_index]
                targets = {None: flat, **{k: self.optimizer.state[flat][k] for k in elementwise}}
                sources = {None: value, **elementwise}
                for key, target in targets.items():
                    fragment = sources[key].flatten().float().narrow(0, lp.start, lp.numel)
                    target.narrow(0, hp.start, hp.numel).copy_(fragment.to(target.device))
        for group, loaded in zip(self.optimizer.param_groups, shadow.param_groups):
            group.update({k: v for k, v in loaded.items() if k != "params"})

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state.

        Counted from the tensors the engine really holds, each storage once
        (ZeRO keeps parameters as views into flat buffers, and in fp32 ZeRO-3
        the fp32 master *is* the parameter partition, with no second copy):

        * parameters: stages 1 and 2, the module's whole parameters; ZeRO-3,
          this rank's flat partition, plus parameters DeepSpeed keeps whole
          (``ds_persist``: under ``stage3_param_persistence_threshold``).
        * gradients: stage 1 keeps whole gradients in ``param.grad`` across the
          accumulation window; stages 2 and 3 reduce-scatter at every micro-step
          and keep only this rank's partition, in the parameters' dtype (sized
          from the partition, since the buffer is only allocated during steps).
        * optimizer_state: the fp32 master partition where it is a separate
          copy (stages 1 and 2 always clone it, ZeRO-3 in bf16/fp16) plus the
          client optimizer's state tensors, which live over that partition.

        Communication buckets are not counted (nor are DDP's).
        """
        assert self.module is not None and self.engine is not None and self.optimizer is not None
        zero = self.engine.optimizer
        seen: set[int] = set()

        def held(tensors: Any) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        module_params = list(self.module.parameters())
        if self.stage == 3:
            params = held(p.ds_tensor for p in module_params)
            params += held(p.data for p in module_params if getattr(p, "ds_persist", False))
            masters = list(zero.fp32_partitioned_groups_flat)
        else:
            params = held(p.data for p in module_params)
            masters = list(zero.single_partition_of_fp32_groups)
        master_bytes = held(masters)
        if self.stage == 1:
            grads = sum(p.numel() * p.element_size() for p in module_params if p.requires_grad)
        else:
            elem = module_params[0].element_size()
            grads = sum(t.numel() for t in masters) * elem
        state = held(
            t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
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
            # ZeRO-Infinity-style CPU offload is the one preset worth a name.
            aliases={"zero3_offload": {"offload_optimizer": "cpu", "offload_param": "cpu"}} if stage == 3 else {},
            unavailable=unavailable,
        )
        for stage in (1, 2, 3)
    ]

"""One fit as the :class:`~unison.training.trainer.Trainer` holds it: a single private record.

``fit`` sets one attribute of the trainer, its record, once it has checked its inputs; what the fit
decided is read through the trainer's read-only properties (``env``, ``run_dir``, ``checkpointer``,
``resumed_from``, ``precision``, ``data``, ...), which have no setters, so no part can assign into the
trainer. The values the record holds are frozen and each is made once: the :class:`FitPlan` of the
checks before any process group (:func:`unison.training.preflight.prepare_fit`), the :class:`World`
joined (:func:`unison.training.world.join_world`), the :class:`RunPlace` the ranks agreed on
(:func:`unison.training.runs.agree`). The parts built from them (precision, scheduler, checkpoint
manager, validator, loop) are added as ``fit`` builds them, in that order. The trainer's documented
results are the only attributes a fit changes besides the record: ``progress``, ``last_validation``,
``should_stop`` (the agreed stop flag) and what :meth:`~unison.training.trainer.Trainer.full_state_dict`
returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from unison.contract.precision import Precision
    from unison.launch.lifecycle import RunGuard
    from unison.launch.setup_report import SetupReport
    from unison.launch.watchdog import Watchdog
    from unison.training.checkpointing import CheckpointManager
    from unison.training.loop import TrainLoop
    from unison.training.preflight import FitPlan
    from unison.training.runs import RunPlace
    from unison.training.validation import Validator
    from unison.training.world import World

__all__ = ["FitRecord"]


@dataclass
class FitRecord:
    """The values of one fit and the parts built from them (see the module's docstring)."""

    plan: FitPlan
    say: SetupReport
    guard: RunGuard
    #: Where this rank is, (step, phase), for the stall watchdog (inert until the world is joined).
    watchdog: Watchdog
    #: The run directory and checkpointer: the plan's, then the one every rank agreed on.
    place: RunPlace
    world: World | None = None
    #: The world is joined and the fit has not ended: its control group can be used.
    active: bool = False
    precision: Precision | None = None
    lr_scheduler: Any = None
    checkpoints: CheckpointManager | None = None
    validator: Validator | None = None
    loop: TrainLoop | None = None
    #: The canonical state at the fit's end (``full_state_dict()`` after the strategy is torn down).
    final_state: dict[str, torch.Tensor] | None = None

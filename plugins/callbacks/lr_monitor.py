"""Per-parameter-group optimizer hyperparameters, by group name.

The trainer already logs ``train/lr`` and ``train/lr-group{i}``. This callback
adds what those do not say: groups by their own ``"name"`` key when the
optimizer's param groups have one (``lr/decoder``), and optionally the
momentum (``momentum`` or Adam's ``betas[0]``) and weight decay of each group.
Values are read from ``trainer.strategy.optimizer.param_groups`` after the
step, on logging steps, and are the same on every rank and backend.
"""

from __future__ import annotations

from typing import Any

from unison.plugin import hookimpl


class LearningRateMonitor:
    """Logs ``lr/<group>`` (and ``momentum/<group>``, ``weight_decay/<group>``) every logging step.

    Args:
        log_momentum: also log each group's momentum (``betas[0]`` for Adam-style optimizers).
        log_weight_decay: also log each group's weight decay.
    """

    def __init__(self, log_momentum: bool = False, log_weight_decay: bool = False) -> None:
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay

    @staticmethod
    def group_names(param_groups: list[dict[str, Any]]) -> list[str]:
        """Each group's ``"name"`` when it has one, else ``group{i}``."""
        return [str(g.get("name", f"group{i}")) for i, g in enumerate(param_groups)]

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        if (step + 1) % trainer.settings.log_every_n_steps:
            return
        groups = trainer.strategy.optimizer.param_groups
        metrics: dict[str, float] = {}
        for name, group, lr in zip(self.group_names(groups), groups, output.lrs):
            metrics[f"lr/{name}"] = float(lr)  # the lr the step used (the scheduler may have moved the group's)
            if self.log_momentum:
                momentum = group.get("momentum", (group.get("betas") or (None,))[0])
                if momentum is not None:
                    metrics[f"momentum/{name}"] = float(momentum)
            if self.log_weight_decay and "weight_decay" in group:
                metrics[f"weight_decay/{name}"] = float(group["weight_decay"])
        trainer.log(metrics)

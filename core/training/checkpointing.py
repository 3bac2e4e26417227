"""A fit's checkpoints: when to save, and what a checkpoint holds.

:class:`CheckpointManager` owns the policy (:meth:`~CheckpointManager.should_save`
every ``checkpoint_every_n_steps``, :meth:`~CheckpointManager.should_save_at_end`
once at the end unless that step was just committed) and the list of what a
checkpoint holds, handed to it as :class:`Stateful` objects when the fit is
set up, so neither the loop nor the trainer assembles checkpoint contents:

* the strategy's model and optimizer state, saved and loaded as files in its
  declared format (``state/``; :meth:`Strategy.save_state`);
* every rank's RNG (:class:`RNGState`, ``rng/rank-N.pt``);
* ``trainer.pt`` (rank 0): one entry per named :class:`Stateful`: the
  :class:`~unison.training.outputs.Progress` counters, the scheduler, the
  precision (loss scale), the data position (:class:`DataPosition`), plus what
  ``unison_on_save_checkpoint`` hooks add.

The rules of the directory itself (atomic commits, verification, pruning, the
one-writer lease) are the :class:`~unison.checkpointing.checkpointer.Checkpointer`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.resume import ResumeRequest
from unison.contract.env import DistEnv
from unison.contract.outputs import Progress
from unison.contract.settings import TrainerSettings
from unison.contract.state import rng_state, seed_everything, set_rng_state
from unison.data.loader import TrainData
from unison.errors import ConfigurationError
from unison.launch import messages

if TYPE_CHECKING:
    from unison.contract.strategy import Strategy
    from unison.training.trainer import Trainer

__all__ = ["CheckpointManager", "DataPosition", "RNGState", "Stateful"]


class Stateful(Protocol):
    """Anything a checkpoint can hold: ``state_dict()`` out, ``load_state_dict(state)`` back in."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class RNGState:
    """This rank's Python, NumPy and torch RNGs (:func:`unison.contract.state.rng_state`) as a :class:`Stateful`."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


class DataPosition:
    """The data position as a :class:`Stateful`: the global step is the position, so loading only checks
    that the resumed run's data is the data the checkpoint was trained on (:meth:`TrainData.check_resume`)."""

    def __init__(self, data: TrainData, progress: Progress) -> None:
        self._data, self._progress = data, progress

    def state_dict(self) -> dict[str, Any]:
        return self._data.state_dict(self._progress.global_step)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._data.check_resume(state)


class CheckpointManager:
    """Saves and loads one fit's checkpoints through ``checkpointer`` (``None``: this fit saves none).

    ``states`` name the entries of ``trainer.pt`` (saved in this order, loaded
    in this order; ``None`` saves ``None``, e.g. no scheduler). The fit's
    values it needs come through the constructor: the settings, the strategy
    whose state it writes and reads, this rank's place in the world.
    ``trainer`` is what the checkpoint hooks receive; its ``progress`` is the
    step saved and restored.
    """

    def __init__(
        self,
        trainer: Trainer,
        checkpointer: Checkpointer | None,
        states: dict[str, Stateful | None],
        *,
        settings: TrainerSettings,
        strategy: Strategy,
        env: DistEnv,
    ) -> None:
        self._trainer = trainer
        self.checkpointer = checkpointer
        self._states = states
        self._settings, self._strategy, self._env = settings, strategy, env
        self._rng = RNGState()
        self._every_n_steps = settings.checkpoint_every_n_steps
        #: ``{"step": N, "checkpoint": PATH}`` of the checkpoint :meth:`load` loaded (``trainer.resumed_from``).
        self.resumed_from: dict[str, Any] | None = None

    # -- policy ------------------------------------------------------------------ #
    def should_save(self, step: int) -> bool:
        """Whether the loop saves after ``step`` optimizer steps (``checkpoint_every_n_steps``)."""
        every = self._every_n_steps
        if not every:
            return False
        return self.checkpointer is not None and step % every == 0

    def should_save_at_end(self, step: int) -> bool:
        """Whether ``fit`` saves after its last step: always with a checkpoint directory, unless ``step`` was
        just committed (or resumed from at the end: committed already)."""
        return self.checkpointer is not None and self.checkpointer.last_step != step

    # -- save ---------------------------------------------------------------------- #
    def save(self) -> Path:
        """Write and commit a checkpoint for the current step (collective: every rank)."""
        trainer, checkpointer, strategy, env = self._trainer, self.checkpointer, self._strategy, self._env
        assert checkpointer is not None

        def write(directory: Path) -> dict[str, Any]:
            strategy.save_state(directory / "state")
            checkpointer.write_rng(directory, env.rank, self._rng.state_dict())
            state = {name: s.state_dict() if s is not None else None for name, s in self._states.items()}
            trainer.pm.unison_on_save_checkpoint(trainer=trainer, checkpoint=state)
            checkpointer.write_trainer_state(directory, state, write=env.rank == 0)
            return {
                "strategy": strategy.name,
                "world_size": env.world_size,
                "precision": self._settings.precision,
                "state_dict": strategy.ownership.to_dict()["state_dict"],
            }

        return checkpointer.save(trainer.progress.global_step, write)

    # -- load ---------------------------------------------------------------------- #
    def load(self, resume: ResumeRequest) -> None:
        """Restore the checkpoint ``resume`` names (collective: verifies every file before loading any).

        ``auto`` with nothing committed yet is a fresh start. A checkpoint in a
        format its strategy declares not reshardable loads only at its own
        world size. At another world size no RNG was saved for this rank: one
        is derived from the seed, the step and the rank, so the run stays
        deterministic.
        """
        trainer, env, settings = self._trainer, self._env, self._settings
        checkpointer = self.checkpointer or Checkpointer(resume.local_path.parent)
        found = checkpointer.select(resume)
        if found is None:  # "auto" and nothing committed yet: a fresh start
            return
        path, meta = found.path, found.manifest
        assert meta is not None
        if meta.world_size != env.world_size and not meta.state_dict["reshardable"]:
            raise ConfigurationError(
                "ckpt_path",
                f"{path} was written by {meta.strategy!r} at world size {meta.world_size} in a format it "
                f"declares not reshardable; this run has world size {env.world_size}",
                f"resume at world size {meta.world_size}",
            )
        self._strategy.load_state(checkpointer.storage.localize(path / "state"))  # object storage: downloaded
        state = checkpointer.read_trainer_state(path)
        for name, stateful in self._states.items():
            if stateful is not None and state.get(name) is not None:
                stateful.load_state_dict(state[name])
        rng = checkpointer.read_rng(path, env.rank) if meta.world_size == env.world_size else None
        if rng is not None:
            self._rng.load_state_dict(rng)
        else:
            seed_everything(settings.seed + trainer.progress.global_step + 7919 * env.rank)
        trainer.pm.unison_on_load_checkpoint(trainer=trainer, checkpoint=state)
        self.resumed_from = {"step": trainer.progress.global_step, "checkpoint": str(path)}
        if env.rank == 0 and settings.progress != "off":  # an info line, like the progress display's
            messages.say(f"unison: resuming from step {trainer.progress.global_step}: {path}")

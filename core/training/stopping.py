"""Every rank's wish to stop, agreed without a blocking collective per step.

A rank may want to stop on its own: a plugin sets ``trainer.should_stop`` (a
per-rank wall-clock limit, early stopping), or a stop signal reaches it
(SIGTERM/SIGUSR1, held by :class:`~unison.launch.lifecycle.RunGuard`). Every
rank must still stop after the same optimizer step and, for a signal, commit
one checkpoint and raise :class:`~unison.launch.lifecycle.Preempted` on every
rank. In a world the flags ``[should_stop, stop requested, signal number]``
are all-reduced (MAX) on the CPU control group, and when:

* After step k the all-reduce is *started* (``async_op=True``) and training
  goes on; it is waited for at the boundary of step k+1, before that step's
  validation and checkpoint, so no other collective of the trainer starts on
  the group while it is in flight. A stop asked for during step k therefore
  stops every rank after step k+1: a one-step lag, the price of taking the
  collective off the critical path (a blocking all-reduce at every boundary
  waits for the slowest rank, 0.5-0.9 ms a step on the benchmark machine).
* A boundary that validated or saved a checkpoint, and one whose waited flags
  ask to stop, agree at once on the current flags (one blocking all-reduce,
  where the step blocks anyway): a stop decided from a validation (early
  stopping) ends the fit after that step on every backend, as at world 1; a
  stop asked for by a saving step stops there, so a preemption commits that
  step's checkpoint and not a second one a step later; and the final decision
  (stop, and whether a signal reached any rank) is the one every rank takes.
* After the last step (``max_steps`` or the end of the data) the outstanding
  agreement is waited for; a stop request in it still commits a checkpoint
  and raises ``Preempted`` on every rank. A request that reaches a rank after
  the last boundary is not seen, as before any agreement.

Where the step's loss all-reduce already runs over the whole world on the CPU
(:attr:`StopAgreement.carried`: a strategy whose data-parallel replicas are the
world, or one that reports its step losses on some ranks, which the trainer
then sums over the world: a pipeline, tensor parallelism; on a CPU device), the flags of
step k's boundary ride in step k+1's loss all-reduce instead of an all-reduce
of their own: two more numbers summed (counts of the ranks that want to stop
and that received a request), read at step k+1's boundary as above. The lag,
the decisions and what each rank does are the same; a step makes one gloo
collective less, and with it the thread hand-offs and system calls that cost
a small collective more CPU time than its numbers (about 6 context switches a
step per rank on the benchmark machine). A request the carried counts report
is agreed at once on every rank's flags, which names the signal. After the
last step the last boundary's flags, which no step carried, are agreed in one
all-reduce on the control group.

At world 1 the local flags decide at every boundary: no collective, no lag.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from unison.contract.env import DistEnv
    from unison.launch.lifecycle import RunGuard
    from unison.training.trainer import Trainer

__all__ = ["StopAgreement"]


class StopAgreement:
    """One fit's stop agreement over ``control_group`` (the fit's CPU group; ``None``: the default group) in
    the world ``env``; ``trainer`` holds ``should_stop`` (read, then set to what every rank agreed) and is
    what a preemption's hooks receive."""

    def __init__(
        self, trainer: Trainer, guard: RunGuard | None, control_group: Any, env: DistEnv, *, carried: bool = False
    ) -> None:
        self.trainer, self.guard, self.group, self.env = trainer, guard, control_group, env
        #: The loop's loss all-reduce carries the flags (:meth:`outgoing`, :meth:`incoming`): the caller
        #: guarantees it sums over every rank of the world, on the CPU, at every step.
        self.carried = carried and self.collective
        #: The all-reduce started at the last boundary and its flags tensor, until waited for.
        self._pending: tuple[Any, torch.Tensor] | None = None
        #: Flags of the last waited all-reduce, until a boundary decides on them.
        self._agreed: torch.Tensor | None = None
        #: ``carried``: the last boundary's flags, until a step's loss all-reduce (or :meth:`finish`) takes them.
        self._outgoing: torch.Tensor | None = None
        #: ``carried``: the step's loss all-reduce carries a boundary's flags (not zeros in their place).
        self._carrying = False

    def outgoing(self) -> torch.Tensor:
        """``carried``: the two numbers this rank adds to the step's loss all-reduce, ``[should_stop, stop
        requested]`` at the last boundary (zeros when that boundary agreed at once, or before the first)."""
        flags, self._outgoing = self._outgoing, None
        self._carrying = flags is not None  # alike on every rank: every rank passed the same boundaries
        return flags[:2] if flags is not None else torch.zeros(2)

    def incoming(self, summed: torch.Tensor) -> None:
        """``carried``: the two numbers summed over the world (counts of ranks), for the next boundary; ignored
        when no boundary's flags were in them (the first step, a step after an agreement made at once)."""
        if not self._carrying:
            return
        self._agreed = torch.cat([summed.detach().float(), torch.zeros(1)])  # a CPU tensor: carried on the CPU only

    @property
    def collective(self) -> bool:
        return self.env.distributed and self.env.world_size > 1

    def collect(self) -> None:
        """Wait for the all-reduce started at the previous boundary (if one is in flight) and keep its flags.

        Called before anything else runs a collective of the trainer's on the
        control group: a boundary's validation and checkpoint, the non-finite
        error's gather. Every rank started it at the same boundary.
        """
        if self._pending is None:
            return
        work, flags = self._pending
        self._pending = None
        work.wait()
        self._agreed = flags

    def agree(self, *, now: bool = False) -> bool:
        """At a step boundary, after its validation and checkpoint: whether every rank stops after this step.

        ``now``: agree on the current flags at once (the step saved a
        checkpoint). On a stop request the checkpoint is committed and
        ``Preempted`` raised here, on every rank.
        """
        if not self.collective:
            return self._decide(None)
        self.collect()
        agreed, self._agreed = self._agreed, None
        flags = self._local()
        if now or (agreed is not None and any(self._read(agreed)[:2])):
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
            return self._decide(flags if agreed is None else torch.maximum(flags, agreed))
        if self.carried:
            self._outgoing = flags  # the next step's loss all-reduce carries them
            return False
        work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flags)
        return False

    def finish(self) -> None:
        """After the loop: wait for the last boundary's all-reduce and honour a stop request it carries."""
        self.collect()
        agreed, self._agreed = self._agreed, None
        if self._outgoing is not None:  # carried: no step took the last boundary's flags
            flags, self._outgoing = self._outgoing, None
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
            agreed = flags
        if agreed is not None:
            self._decide(agreed)

    def _local(self) -> torch.Tensor:
        guard = self.guard
        requested = guard is not None and guard.received is not None
        signum = guard.signum if guard is not None else 0
        return torch.tensor([float(self.trainer.should_stop), float(requested), float(signum)])

    @staticmethod
    def _read(flags: torch.Tensor) -> tuple[bool, bool, int]:
        """The agreed ``(should_stop, stop requested, signal number)``: a CPU tensor read on the host."""
        stop, requested, signum = flags.tolist()
        return bool(stop), bool(requested), int(signum)

    def _decide(self, flags: torch.Tensor | None) -> bool:
        """Act on agreed ``flags`` (``None``: this rank's own, at world 1): preempt on a request, else stop or not.

        Only the agreed flags decide whether a request stops the run, so every
        rank acts alike; this rank's own signal, when it has one, names it.
        """
        trainer, guard = self.trainer, self.guard
        requested = guard.received if guard is not None else None
        if flags is not None:
            stop, asked, signum = self._read(flags)
            trainer.should_stop = stop
            if not asked:
                requested = None
            elif requested is None:
                # Every rank names the signal, whichever rank it reached first.
                requested = signal.Signals(signum).name if signum else "a stop request on another rank"
        if requested is not None and guard is not None:
            guard.preempt(trainer, requested)
        return trainer.should_stop

"""A tiny 2-rank ddp job for the operations tests (stragglers, JSON logs, metrics servers, a frozen rank).

    unison run --nproc 2 [--log-format json] tests/ops_worlds.py [--slow RANK:SECONDS]
        [--prometheus PORT] [--pushgateway URL] [--otlp URL] [--freeze RANK:STEP] [--steps N] [--stall S]

``--slow 1:0.2`` sleeps 0.2 s in ``unison_on_after_backward`` on rank 1 (inside the step, before the
replica loss reduction that rank 0 then waits in). ``--prometheus PORT`` serves each rank's metrics on
``127.0.0.1:PORT+LOCAL_RANK``; ``--pushgateway URL`` pushes them there. ``--freeze 1:5`` makes rank 1
sleep two heartbeat intervals at the end of step 5 (so its last heartbeat carries its last collective),
write ``OUT.frozen`` and stop itself with SIGSTOP. Every rank writes its pid to ``OUT.pid-RANK``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import warnings

import torch

import unison
from unison.launch.watchdog import heartbeat_interval
from unison.plugins.callbacks import StragglerReport

from lifecycle_worlds import data, model


class Slow:
    """Sleeps ``seconds`` inside every optimizer step on one rank."""

    def __init__(self, spec: str | None) -> None:
        who, seconds = spec.split(":") if spec else ("-1", "0")
        self.seconds = float(seconds) if who == os.environ.get("RANK", "0") else 0.0

    @unison.hookimpl
    def unison_on_fit_start(self, trainer):
        if self.seconds:  # a warning from the slow rank: its rank must show in the log record
            warnings.warn(f"rank {trainer.env.rank} sleeps {self.seconds} s per step", stacklevel=1)

    @unison.hookimpl
    def unison_on_after_backward(self, step):
        if self.seconds:
            time.sleep(self.seconds)


class Freeze:
    """At the end of one step: wait two heartbeats, note the time, stop this process (SIGSTOP)."""

    def __init__(self, spec: str | None, out: str, stall: float) -> None:
        who, step = spec.split(":") if spec else ("-1", "0")
        self.step = int(step) if who == os.environ.get("RANK", "0") else None
        self.out, self.pause = out, 2 * heartbeat_interval(stall)

    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if self.step is not None and step + 1 == self.step:
            time.sleep(self.pause)  # rank 0 waits in a collective meanwhile; this rank's heartbeat goes on
            with open(self.out + ".frozen", "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stall", type=float, default=300.0)
    p.add_argument("--slow", default=None, help="RANK:SECONDS")
    p.add_argument("--freeze", default=None, help="RANK:STEP")
    p.add_argument("--prometheus", type=int, default=None, help="first port")
    p.add_argument("--pushgateway", default=None)
    p.add_argument("--otlp", default=None, help="OTLP HTTP metrics endpoint")
    p.add_argument("--out", default=os.devnull)
    args = p.parse_args()
    with open(f"{args.out}.pid-{os.environ.get('RANK', '0')}", "w") as f:
        f.write(str(os.getpid()))
    callbacks: list = [StragglerReport(threshold=1.3), Slow(args.slow), Freeze(args.freeze, args.out, args.stall)]
    if args.prometheus is not None or args.pushgateway is not None:
        from unison.plugins.loggers.prometheus import PrometheusLogger

        if args.prometheus is not None:
            callbacks.append(PrometheusLogger(port=args.prometheus, addr="127.0.0.1"))
        if args.pushgateway is not None:
            callbacks.append(PrometheusLogger(port=None, pushgateway=args.pushgateway, job="unison-push"))
    if args.otlp is not None:
        from unison.plugins.loggers.otel import OpenTelemetryLogger

        callbacks.append(OpenTelemetryLogger(endpoint=args.otlp, export_every_s=60))
    trainer = unison.Trainer(
        strategy="ddp",
        global_batch_size=8,
        accumulate_grad_batches=2,
        max_steps=args.steps,
        seed=0,
        progress="plain",
        progress_every_n_steps=2,
        log_every_n_steps=2,
        stall_timeout_s=args.stall,
        callbacks=callbacks,
    )
    trainer.fit(
        model(),
        data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )


if __name__ == "__main__":
    main()

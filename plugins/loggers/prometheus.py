"""Prometheus metrics: every rank's, served for scraping or pushed to a Pushgateway.

``PrometheusLogger(port=9400)`` serves each rank's metrics at ``http://ADDR:PORT+LOCAL_RANK/metrics``
while ``fit`` runs (rank 0 of a node on 9400, rank 1 on 9401...), for a Prometheus that scrapes the
job's pods or hosts. ``PrometheusLogger(port=None, pushgateway="http://gw:9091")`` pushes them
instead, for jobs shorter than a scrape interval: at most every ``push_every_s`` seconds on logging
steps, and once more when the fit ends (grouped by job, run id and rank, so ranks never overwrite
one another). Both may be given.

The instruments and their names are :mod:`._instruments`'s table (``unison_train_loss``,
``unison_step_time_seconds``, ``unison_skipped_steps_total``...); every series carries the labels
``run_id``, ``strategy``, ``rank`` and ``node``. Every rank exports its own values: its step time,
its memory, its wait in collectives; the trainer's reduced values (loss, grad norm) are the same on
every rank. Needs the ``prometheus`` extra (``pip install 'unison[prometheus]'``). A failed push is a
warning (once per fit), never a training error; a port already in use is an error at fit start.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from unison.errors import ConfigurationError
from unison.plugin import hookimpl

from ._base import require
from ._instruments import BY_KEY, Counts, FinishesAtFitEnd, identity, prometheus_name, restarts

LABELS = ("run_id", "strategy", "rank", "node")


class PrometheusLogger(FinishesAtFitEnd):
    """Exports every rank's metrics to Prometheus (a pluggy plugin; see the module docstring).

    Args:
        port: the first port to serve on; each rank adds its ``LOCAL_RANK``. ``None``: do not serve.
        addr: the address to serve on (``0.0.0.0``: every interface, as a scraper in the cluster needs).
        pushgateway: a Pushgateway URL to push to (``None``: do not push).
        job: the Pushgateway's ``job`` label.
        push_every_s: the least seconds between two pushes during the fit.
    """

    def __init__(
        self,
        port: int | None = 9400,
        *,
        addr: str = "0.0.0.0",
        pushgateway: str | None = None,
        job: str = "unison",
        push_every_s: float = 15.0,
    ) -> None:
        require("prometheus_client", "prometheus", "PrometheusLogger")
        if port is None and pushgateway is None:
            raise ConfigurationError(
                "PrometheusLogger",
                "neither a port to serve on nor a pushgateway was given",
                "pass port=9400 or pushgateway='http://HOST:9091'",
            )
        if port is not None and not 0 < port < 65536:
            raise ConfigurationError("PrometheusLogger.port", f"got {port!r}", "pass a TCP port, e.g. 9400")
        self.port, self.addr, self.pushgateway, self.job = port, addr, pushgateway, job
        self.push_every_s = float(push_every_s)
        #: ``http://ADDR:PORT/metrics`` this rank serves during a fit, else ``None``.
        self.url: str | None = None
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}
        self._labels: dict[str, str] = {}
        self._server: Any = None
        self._counts = Counts()
        self._pushed_at = 0.0
        self._push_warned = False

    # -- hooks ------------------------------------------------------------------ #
    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry()  # this fit's own: a second fit never meets the first's series
        self._gauges, self._counts, self._push_warned = {}, Counts(), False
        self._labels = identity(trainer)
        self._set("restarts", restarts())
        if self.port is not None:
            port = self.port + int(os.environ.get("LOCAL_RANK", "0"))
            try:
                self._server, _ = start_http_server(port, addr=self.addr, registry=self._registry)
            except OSError as exc:
                raise ConfigurationError(
                    "PrometheusLogger.port",
                    f"rank {self._labels['rank']} cannot serve on {self.addr}:{port} ({exc})",
                    "choose a free first port (each rank on a node adds its LOCAL_RANK)",
                ) from exc
            self.url = f"http://{self.addr}:{port}/metrics"

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self._registry is None:  # outside fit(): nothing is served or pushed
            return
        self._set("step", float(step))
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._set(key, float(value))
        if self.pushgateway is not None and time.monotonic() - self._pushed_at >= self.push_every_s:
            self._push()

    # -- helpers ------------------------------------------------------------------- #
    def _set(self, key: str, value: float) -> None:
        from prometheus_client import Counter, Gauge

        name = prometheus_name(key)
        if name is None:
            return
        instrument = BY_KEY.get(key)
        metric = self._gauges.get(key)
        if metric is None:
            help_text = instrument.description if instrument is not None else f"unison metric {key}"
            if instrument is not None and instrument.counter:
                metric = Counter(name.removesuffix("_total"), help_text, LABELS, registry=self._registry)
            else:
                metric = Gauge(name, help_text, LABELS, registry=self._registry)
            self._gauges[key] = metric
        series: Any = metric.labels(**self._labels)  # a Counter's or a Gauge's child
        if instrument is not None and instrument.counter:
            series.inc(self._counts.increase(key, value))
        else:
            series.set(value * (instrument.scale if instrument is not None else 1.0))

    def _push(self) -> None:
        from prometheus_client import push_to_gateway

        assert self.pushgateway is not None
        self._pushed_at = time.monotonic()
        try:
            push_to_gateway(
                self.pushgateway,
                job=self.job,
                registry=self._registry,
                grouping_key={"run_id": self._labels["run_id"], "rank": self._labels["rank"]},
                timeout=10,
            )
        except Exception as exc:  # the network or the gateway: metrics must not stop training
            if not self._push_warned:
                warnings.warn(f"pushing metrics to {self.pushgateway} failed: {exc}", stacklevel=2)
                self._push_warned = True

    def _finish(self) -> None:
        if self._registry is None:
            return
        if self.pushgateway is not None:
            self._push()  # the final values, for a job shorter than a push interval
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._registry = None

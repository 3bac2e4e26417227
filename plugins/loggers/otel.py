"""OpenTelemetry metrics: every rank's, exported over OTLP/HTTP to a collector.

``OpenTelemetryLogger(endpoint="http://collector:4318/v1/metrics")`` gives each rank a
``MeterProvider`` of its own (the global one is left alone) whose reader exports every
``export_every_s`` seconds and once more when the fit ends. ``endpoint=None`` takes the standard
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables, as the OTLP
exporter reads them (and ``OTEL_EXPORTER_OTLP_HEADERS`` for credentials).

The instruments are :mod:`._instruments`'s table under their OpenTelemetry names and units
(``unison.train.loss``, ``unison.step.duration`` in ``s``, ``unison.skipped_steps`` a counter...);
the resource attributes carry the same identities as the Prometheus labels: ``unison.run_id``,
``unison.strategy``, ``unison.rank``, ``unison.node``, with ``service.name`` (``unison`` unless given),
``service.instance.id`` (``RUN_ID/RANK``) and ``host.name``. Needs the ``otel`` extra
(``pip install 'unison[otel]'``: ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``).
An export that fails is the SDK's logged warning, never a training error.
"""

from __future__ import annotations

from typing import Any

from unison.plugin import hookimpl

from ._base import require
from ._instruments import BY_KEY, Counts, FinishesAtFitEnd, identity, otel_name, restarts


class OpenTelemetryLogger(FinishesAtFitEnd):
    """Exports every rank's metrics over OTLP/HTTP (a pluggy plugin; see the module docstring).

    Args:
        endpoint: the OTLP/HTTP metrics URL (``.../v1/metrics``); ``None``: the ``OTEL_EXPORTER_OTLP_*``
            variables.
        export_every_s: seconds between exports during the fit.
        service_name: the ``service.name`` resource attribute.
        headers: HTTP headers for the collector (credentials).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        export_every_s: float = 10.0,
        service_name: str = "unison",
        headers: dict[str, str] | None = None,
    ) -> None:
        require("opentelemetry.sdk", "otel", "OpenTelemetryLogger")
        require("opentelemetry.exporter.otlp.proto.http", "otel", "OpenTelemetryLogger")
        self.endpoint, self.export_every_s = endpoint, float(export_every_s)
        self.service_name, self.headers = service_name, headers
        self._provider: Any = None
        self._meter: Any = None
        self._instruments: dict[str, Any] = {}
        self._counts = Counts()

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        ids = identity(trainer)
        resource = Resource.create(
            {
                "service.name": self.service_name,
                "service.instance.id": f"{ids['run_id']}/{ids['rank']}",
                "host.name": ids["node"],
                **{f"unison.{k}": v for k, v in ids.items()},
            }
        )
        exporter = OTLPMetricExporter(endpoint=self.endpoint, headers=self.headers)
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=self.export_every_s * 1000)
        self._provider = MeterProvider(resource=resource, metric_readers=[reader])
        self._meter = self._provider.get_meter("unison")
        self._instruments, self._counts = {}, Counts()
        self._record("restarts", restarts())

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self._meter is None:  # outside fit(): no provider to export with
            return
        self._record("step", float(step))
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._record(key, float(value))

    def _record(self, key: str, value: float) -> None:
        spec = BY_KEY.get(key)
        instrument = self._instruments.get(key)
        if instrument is None:
            name, unit = otel_name(key), spec.unit if spec is not None else "1"
            description = spec.description if spec is not None else f"unison metric {key}"
            if spec is not None and spec.counter:
                instrument = self._meter.create_counter(name, unit=unit, description=description)
            else:
                instrument = self._meter.create_gauge(name, unit=unit, description=description)
            self._instruments[key] = instrument
        if spec is not None and spec.counter:
            instrument.add(self._counts.increase(key, value))
        else:
            instrument.set(value * (spec.scale if spec is not None else 1.0))

    def _finish(self) -> None:
        if self._provider is None:
            return
        provider, self._provider, self._meter = self._provider, None, None
        provider.force_flush()  # the final values: the reader's last export
        provider.shutdown()

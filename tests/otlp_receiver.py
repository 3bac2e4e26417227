"""An in-process OTLP/HTTP metrics receiver for the tests: a tiny ``http.server`` on 127.0.0.1.

No OpenTelemetry collector is packaged for this machine, so the tests receive the exporter's real HTTP
requests here and decode each body with ``opentelemetry-proto``'s ``ExportMetricsServiceRequest``, as a
collector's OTLP/HTTP receiver would (protobuf, ``POST /v1/metrics``).
"""

from __future__ import annotations

import gzip
import http.server
import threading
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)


class OTLPReceiver:
    """``with OTLPReceiver() as r:`` serves ``r.endpoint``; ``r.requests`` holds the decoded requests."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                reply = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def by_rank(self) -> dict[str, dict[str, Any]]:
        """``{rank: {"resource": {attribute: value}, "metrics": {name: (unit, kind, last value)}}}``."""
        out: dict[str, dict[str, Any]] = {}
        for request in self.requests:
            for rm in request.resource_metrics:
                attrs = {a.key: _value(a.value) for a in rm.resource.attributes}
                entry = out.setdefault(str(attrs.get("unison.rank")), {"resource": attrs, "metrics": {}})
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        points = getattr(metric, kind).data_points
                        if points:
                            point = points[-1]
                            value = point.as_double if point.HasField("as_double") else point.as_int
                            entry["metrics"][metric.name] = (metric.unit, kind, value)
        return out


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))

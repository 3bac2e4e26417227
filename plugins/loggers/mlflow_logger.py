"""MLflow tracking: one MLflow run per fit, through ``mlflow.MlflowClient``.

Metrics go with ``log_batch`` at the trainer's step. At the start of a fit the
resolved config is logged as parameters (flattened, ``trainer.max_steps``),
the strategy and versions as tags (``unison.contract.strategy``,
``unison.version.torch``), and the whole metadata (config, strategy
declaration, versions) as the artifact ``unison/run.json``. The run ends
``FINISHED``, or ``FAILED`` when fit raised. Needs
``pip install 'unison[mlflow]'``.

``tracking_uri`` names the server (``http://127.0.0.1:5000``) or store
(``sqlite:///mlflow.db``); ``None`` uses MLflow's own default
(``MLFLOW_TRACKING_URI``, else its local store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from ._base import RunLogger, require
from ._run import RunDirectory, flatten

_MAX_PARAM = 6000  # MLflow's limit on a parameter value's length
_BATCH = 100  # MLflow's limit on parameters/tags per log_batch


class MLflowLogger(RunLogger):
    """Logs each fit as an MLflow run.

    Args:
        run: optional run directory; the MLflow run is then named after its
            version (``tinylm/version_3``), so both stores agree.
        tracking_uri: MLflow tracking server or store URI.
        experiment: experiment name (created when missing).
        run_name: MLflow run name (default: the version name, or MLflow's own).
        tags: extra tags for every run.
    """

    needs_directory = False

    def __init__(
        self,
        run: RunDirectory | str | os.PathLike[str] | None = None,
        *,
        tracking_uri: str | None = None,
        experiment: str = "unison",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        require("mlflow", "mlflow", "MLflowLogger")
        super().__init__(run)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self._client: Any = None
        #: The MLflow run id of the current (or last) fit.
        self.run_id: str | None = None

    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        import mlflow
        from mlflow.entities import Param

        self._client = client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(self.experiment)
        name = self.run_name or (self.run.name if self.run is not None else None)
        tags = {
            "unison.contract.strategy": metadata["strategy"]["name"],
            "unison.world_size": str(metadata["world_size"]),
            **{f"unison.version.{k}": v for k, v in metadata["versions"].items()},
            **self.tags,
        }
        if self.path is not None and self.run is not None:
            tags["unison.run_dir"] = self.run.location  # the URL when the run directory is in object storage
        self.run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        params = [Param(k, str(v)[:_MAX_PARAM]) for k, v in flatten(metadata["config"]).items()]
        for i in range(0, len(params), _BATCH):
            client.log_batch(self.run_id, params=params[i : i + _BATCH])
        client.log_dict(self.run_id, metadata, "unison/run.json")

    def location(self) -> str:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default store"
        return f"the MLflow tracking store {uri}" + (f" (run {self.run_id})" if self.run_id else "")

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        with _errors_reported_by_unison():
            for i in range(0, len(batch), 1000):  # MLflow's limit on metrics per log_batch
                self._client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def _close(self, ok: bool) -> None:
        if self._client is not None and self.run_id is not None:
            with _errors_reported_by_unison():
                self._client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


@contextlib.contextmanager
def _errors_reported_by_unison() -> Iterator[None]:
    """MLflow logs a store error with its traceback before raising it; the raised error is the one the
    write-failure policy reports (once), so MLflow's own error log is held back during these calls."""
    log = logging.getLogger("mlflow")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)

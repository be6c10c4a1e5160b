"""The MLflow tracker: a run per training run in any MLflow store, and one line when it cannot start.

Where it logs (see :mod:`yolokit.train.trackers.catalog` for what): ``$MLFLOW_TRACKING_URI``, which
may be a tracking server (``http://127.0.0.1:5000``, started with ``mlflow server``), a SQL
store (``sqlite:///mlflow.db``, ``postgresql://...``: full ``mlflow``, not ``mlflow-skinny``),
``databricks`` or a file store (MLflow 3 refuses these unless ``MLFLOW_ALLOW_FILE_STORE`` is
set). Unset, the store is what MLflow itself defaults to, kept next to the run folders:
``sqlite:///<out's parent>/mlflow.db`` with artifacts in ``<out's parent>/mlartifacts``, or the
``<out's parent>/mlruns`` file store where earlier runs filled one. Before a server is asked
anything, ``<uri>/health`` must answer within 10 s: an unreachable server is an error at once,
not minutes of the client's retries.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from pathlib import Path
from typing import Any

from yolokit.train.trackers.base import Tracker, TrackerError, _require, flat_config, one_line

SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def default_store(runs: Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location of new experiments) for runs under the folder ``runs``."""
    runs = runs.resolve()
    if any((p / "meta.yaml").is_file() for p in (runs / "mlruns").glob("*")):   # an earlier default: kept
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (runs / "mlruns").as_uri(), None
    return f"sqlite:///{runs / 'mlflow.db'}", (runs / "mlartifacts").as_uri()


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:
        return False
    return True


class MLflowTracker(Tracker):
    """MLflow: config as parameters, step and epoch metrics, charts and weights as artifacts."""

    name = "mlflow"

    def __init__(self, run_dir: Path):
        super().__init__(run_dir)
        self.mlflow, self.client, self.run_id = _require("mlflow"), None, None
        self.uri, self.artifacts = os.environ.get("MLFLOW_TRACKING_URI", ""), None

    def where(self) -> str:
        return self.uri or "MLflow's default store"

    def advice(self, exc: Exception) -> str:
        text, scheme = str(exc), self.uri.split(":", 1)[0].split("+")[0].lower()
        if scheme in SQL_SCHEMES and not _importable("sqlalchemy"):
            return "MLflow's SQL store is not in mlflow-skinny: pip install 'yolokit[mlflow]' (the full mlflow package)"
        if "MLFLOW_ALLOW_FILE_STORE" in text:
            return ("MLflow 3 refuses file stores: use a SQL store (MLFLOW_TRACKING_URI=sqlite:///mlflow.db) or a "
                    "server, or set MLFLOW_ALLOW_FILE_STORE=true")
        # status codes as whole words: a port such as 40389 in the text is not a 403
        login = re.search(r"\b40[13]\b|nauthorized|UNAUTHENTICATED|PERMISSION_DENIED", text)
        if scheme in ("http", "https") and (isinstance(exc, ConnectionError) or not login):   # no server answers
            return ("start the server (mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri "
                    "sqlite:///mlflow.db) or set MLFLOW_TRACKING_URI to one that runs")
        if login:
            return ("the server refused the login: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                    "(or MLFLOW_TRACKING_TOKEN)")
        return ("set MLFLOW_TRACKING_URI to an MLflow store: sqlite:///mlflow.db, a server (http://host:5000) "
                "or databricks; pip install 'yolokit[mlflow]' brings the SQL store and the server")

    def open(self) -> None:
        """The client of the store, and the experiment (made when missing)."""
        if not self.uri:
            self.uri, self.artifacts = default_store(self.run_dir.parent)
        if self.uri.split(":", 1)[0].lower() in ("http", "https"):
            import requests

            try:
                requests.get(self.uri.rstrip("/") + "/health", timeout=10)
            except requests.RequestException as exc:
                raise ConnectionError(f"no server answers ({one_line(exc, 120)})") from None
        self.client = self.mlflow.MlflowClient(self.uri)
        self.experiment_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or self._experiment(
            os.environ.get("MLFLOW_EXPERIMENT_NAME", "yolokit"))

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name, artifact_location=self.artifacts)
            except Exception:                       # another process made it first
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise TrackerError(f"--tracker mlflow: experiment {name!r} at {self.uri} is deleted; restore it "
                               "(mlflow experiments restore) or set MLFLOW_EXPERIMENT_NAME to another")
        return found.experiment_id

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        self.metric = Metric
        self.open()
        self.run_id = self.saved_id()
        if self.run_id is None:
            self.run_id = self.client.create_run(self.experiment_id, run_name=self.run_dir.name).info.run_id
            self.save_id(self.run_id)
            params = [Param(k, str(v)) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):     # MLflow takes at most 100 parameters per call
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            return
        try:
            self.client.get_run(self.run_id)
        except Exception as exc:
            raise TrackerError(f"--tracker mlflow: run {self.run_id} of {self.run_dir / 'trackers.json'} is not in "
                               f"{self.uri} ({one_line(exc, 120)}); set MLFLOW_TRACKING_URI to the store the run "
                               "started in") from None
        self.client.update_run(self.run_id, status="RUNNING")

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now, step) for k, v in values.items()])

    def log_files(self, charts: list[Path], weights: list[Path]) -> None:
        for path in charts:
            self.client.log_artifact(self.run_id, str(path), artifact_path="charts")
        for path in weights:
            self.client.log_artifact(self.run_id, str(path), artifact_path="weights")

    def close(self, status: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(
                status, "FAILED"))
            self.client = None

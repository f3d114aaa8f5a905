"""The loggers of ``obs.loggers`` beyond the run directory's own files: Weights & Biases and MLflow.

One small protocol, :class:`MetricLogger`, and one adapter per backend. :class:`~stalebound.obs.
metrics.RunLogger` hands each step's metrics to every logger after writing ``metrics.jsonl``.
Each backend is imported only when its logger is opened (the ``wandb`` and ``mlflow`` extras).

A resumed run continues the same backend run: the ids are kept in ``RUN_DIR/loggers.json``,
written before the backend run starts, so a run stopped at any point resumes into it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from stalebound.core.errors import ConfigError
from stalebound.obs.config import LOGGER_EXTRAS, ObsConfig

__all__ = [
    "LOGGER_IDS_FILE",
    "MetricLogger",
    "MlflowLogger",
    "WandbLogger",
    "logger_problems",
    "open_loggers",
]

LOGGER_IDS_FILE = "loggers.json"
"""The run directory's record of the backend runs it logs to (``{"wandb": id, "mlflow": id}``)."""


class MetricLogger(Protocol):
    """Where a run's step metrics go: one call per step, then :meth:`close`."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """One training step's metrics (non-finite values included, as they are)."""

    def close(self) -> None:
        """Finish the backend run and write what is buffered."""


def logger_problems(loggers: Sequence[str]) -> list[str]:
    """A line for each logger of ``obs.loggers`` whose package is not installed, naming the extra
    that installs it."""
    problems = []
    for name in loggers:
        module, extra = LOGGER_EXTRAS[name]
        if not _installed(module):
            problems.append(
                f"obs.loggers={list(loggers)}: {name} needs the {module} package, which is not "
                f"installed; install it with pip install 'stalebound[{extra}]', or remove {name}"
            )
    return problems


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules is not importable
        return False


def open_loggers(
    obs: ObsConfig, run_dir: Path, config: Mapping[str, Any], *, resume: bool
) -> list[MetricLogger]:
    """The wandb and MLflow loggers ``obs.loggers`` names (TensorBoard is the RunLogger's own),
    each given the resolved ``config``. ``resume``: continue the backend runs recorded in
    ``RUN_DIR/loggers.json``; otherwise start new ones (and record them there)."""
    ids = _read_ids(run_dir) if resume else {}
    opened: list[MetricLogger] = []
    try:
        if "wandb" in obs.loggers:
            opened.append(WandbLogger(obs, run_dir, config, ids))
        if "mlflow" in obs.loggers:
            opened.append(MlflowLogger(obs, run_dir, config, ids))
    except BaseException:
        for logger in opened:
            logger.close()
        raise
    return opened


class WandbLogger:
    """A Weights & Biases run, ``offline`` by default (files under ``RUN_DIR/wandb``, no network).
    Console capture, system statistics, git and code saving are off: the logger records what the
    job logs and nothing else of the machine."""

    def __init__(
        self, obs: ObsConfig, run_dir: Path, config: Mapping[str, Any], ids: dict[str, str]
    ) -> None:
        import wandb

        resuming = "wandb" in ids
        run_id = ids.get("wandb") or secrets.token_hex(6)
        if not resuming:
            ids["wandb"] = run_id
            _write_ids(run_dir, ids)
        settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
            disable_git=True,
            disable_code=True,
            save_code=False,
        )
        self.run: Any = wandb.init(
            project=obs.wandb_project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            mode=obs.wandb_mode,
            dir=str(run_dir),
            settings=settings,
        )
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run in ``obs.mlflow_tracking_uri``, by default a file store in
    ``RUN_DIR/mlruns``. The config is logged as parameters (flattened, ``train.lr``) when the run
    starts and as the artifact ``config.yaml`` (rewritten by each resume)."""

    _PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch

    def __init__(
        self, obs: ObsConfig, run_dir: Path, config: Mapping[str, Any], ids: dict[str, str]
    ) -> None:
        uri = obs.mlflow_tracking_uri or (run_dir / "mlruns").absolute().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and asks for this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client: Any = MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow")
        if run_id is None:
            found = self.client.get_experiment_by_name(obs.mlflow_experiment)
            experiment = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(obs.mlflow_experiment)
            )
            run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
            ids["mlflow"] = run_id
            _write_ids(run_dir, ids)
            params = [Param(k, v) for k, v in _flatten(config).items()]
            for i in range(0, len(params), self._PARAMS_PER_CALL):
                self.client.log_batch(run_id, params=params[i : i + self._PARAMS_PER_CALL])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id
        self.client.log_dict(run_id, dict(config), "config.yaml")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(k, float(v), stamp, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` → ``{"train.lr": "0.001"}``; lists and null as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _read_ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / LOGGER_IDS_FILE
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{LOGGER_IDS_FILE}={str(path)!r}: cannot be read ({exc}); restore it from a copy, or "
            "remove it to log the rest of the run as new wandb/MLflow runs"
        ) from None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise ConfigError(
            f"{LOGGER_IDS_FILE}={str(path)!r}: not a mapping of logger to run id; restore it "
            "from a copy, or remove it to log the rest of the run as new wandb/MLflow runs"
        )
    return {str(k): v for k, v in ids.items()}


def _write_ids(run_dir: Path, ids: Mapping[str, str]) -> None:
    """Replace ``loggers.json`` whole (a crash leaves the old file or the new one)."""
    path = run_dir / LOGGER_IDS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dict(ids), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)

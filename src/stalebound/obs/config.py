"""Where a run's metrics go besides its own files (the ``obs`` section): pure dataclasses, one
docstring per field."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from stalebound.typedconfig import Invalid

__all__ = ["LOGGER_EXTRAS", "LoggerName", "ObsConfig"]

LoggerName = Literal["tensorboard", "wandb", "mlflow"]

LOGGER_EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "obs"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""Each logger's package (the module imported) and the extra of stalebound that installs it."""


@dataclass
class ObsConfig:
    """The loggers each step's metrics and the resolved config go to. ``metrics.jsonl`` (and the
    run directory's other records) are always written: resuming, ``stalebound audit`` and
    ``stalebound plot`` read them. A resumed run continues the same wandb and MLflow run (their
    ids are kept in ``RUN_DIR/loggers.json``)."""

    loggers: list[LoggerName] = field(default_factory=lambda: ["tensorboard"])
    """Any of ``tensorboard`` (event files under ``RUN_DIR/tensorboard``; ``run.tensorboard:
    false`` also turns them off), ``wandb`` (the ``wandb`` extra; files under ``RUN_DIR/wandb``)
    and ``mlflow`` (the ``mlflow`` extra). An empty list writes the run directory's records
    only."""
    wandb_project: str = "stalebound"
    """The Weights & Biases project of the run."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the run under ``RUN_DIR/wandb`` without reaching a server (upload it
    later with ``wandb sync``); ``online`` streams it to the server ``wandb login`` set up."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow stores the run; ``None``: a file store in ``RUN_DIR/mlruns``
    (``mlflow ui --backend-store-uri RUN_DIR/mlruns`` shows it)."""
    mlflow_experiment: str = "stalebound"
    """The MLflow experiment the run is filed under (created when missing)."""

    def _validate(self) -> Iterator[Invalid]:
        twice = sorted({name for name in self.loggers if self.loggers.count(name) > 1})
        if twice:
            yield Invalid("loggers", f"names {', '.join(twice)} twice", "name each logger once")
        for key in ("wandb_project", "mlflow_experiment"):
            if not getattr(self, key).strip():
                yield Invalid(key, "must not be empty", "give a name, e.g. stalebound")

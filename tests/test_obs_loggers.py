"""``obs.loggers``: a short run on the embedded default logs every step metric and the resolved
config to wandb (offline files) and MLflow (a file store), and a resumed run continues the same
wandb and MLflow runs. Read back from the backends' own files."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from stalebound.cli import main
from stalebound.config import load_config
from stalebound.obs import RunLogger
from stalebound.obs.loggers import LOGGER_IDS_FILE

SHORT = [
    "run.live=false",
    "run.plots=false",
    "run.eval_prompts=8",
    "train.warm_start_steps=2",
    "rollout.consumer_batch_size=4",
    "rollout.group_size=4",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("wandb")  # the default suite installs both (Makefile EXTRAS)
    pytest.importorskip("mlflow")
    run_dir = tmp_path_factory.mktemp("loggers") / "run"
    loggers = "obs.loggers=[wandb,mlflow,tensorboard]"
    assert main(["train", *SHORT, loggers, "run.steps=3", f"run.run_dir={run_dir}"]) == 0
    assert main(["train", f"resume={run_dir}", "run.steps=5", "run.live=false"]) == 0
    return run_dir


def _steps(run: Path) -> dict[int, dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _same(logged: float, written: float | None) -> bool:
    """A backend's value against metrics.jsonl's (which writes NaN as null)."""
    return math.isnan(logged) if written is None else math.isclose(logged, written, rel_tol=1e-6)


# ------------------------------------------------------------------ wandb's offline files


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then 32 KiB
    blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), each record a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _key(item: Any) -> str:
    return str(item.key or ".".join(item.nested_key))


def _wandb_runs(run: Path) -> list[tuple[str, dict[int, dict[str, Any]], dict[str, Any]]]:
    """Each offline run directory's run id, history (step → values) and config."""
    out = []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, history, config = "", {}, {}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = items
            elif kind == "config":
                config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        out.append((run_id, history, config))
    return out


def test_wandb_holds_every_step_metric_in_one_run_across_the_resume(run: Path) -> None:
    ids = json.loads((run / LOGGER_IDS_FILE).read_text())
    runs = _wandb_runs(run)
    assert [r[0] for r in runs] == [ids["wandb"], ids["wandb"]]  # the resume continued it
    assert [sorted(r[1]) for r in runs] == [[1, 2, 3], [4, 5]]
    for step, written in _steps(run).items():
        logged = next(r[1][step] for r in runs if step in r[1])
        for key, value in written.items():
            if key in ("step", "wall_time", "timestamp"):
                continue
            assert _same(float(logged[key]), value), (step, key)


def test_wandb_holds_the_resolved_config(run: Path) -> None:
    saved = yaml.safe_load((run / "config.yaml").read_text())
    for _, _, config in _wandb_runs(run):
        assert config["train"]["lr"] == saved["train"]["lr"]
        assert config["rollout"]["staleness"] == saved["rollout"]["staleness"]
        assert config["obs"]["loggers"] == ["wandb", "mlflow", "tensorboard"]


# ------------------------------------------------------------------------ MLflow's file store


def _mlflow(run: Path) -> Any:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=(run / "mlruns").absolute().as_uri())


def test_mlflow_holds_every_step_metric_in_one_run_across_the_resume(run: Path) -> None:
    client = _mlflow(run)
    experiment = client.get_experiment_by_name("stalebound")
    runs = client.search_runs([experiment.experiment_id])
    ids = json.loads((run / LOGGER_IDS_FILE).read_text())
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    assert runs[0].info.status == "FINISHED"
    steps = _steps(run)
    for key in steps[1]:
        if key in ("step", "wall_time", "timestamp"):
            continue
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
        assert sorted(history) == [1, 2, 3, 4, 5], key
        assert all(_same(history[s], steps[s][key]) for s in steps), key


def test_mlflow_holds_the_resolved_config(run: Path) -> None:
    client = _mlflow(run)
    run_id = json.loads((run / LOGGER_IDS_FILE).read_text())["mlflow"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    params = client.get_run(run_id).data.params
    assert float(params["train.lr"]) == saved["train"]["lr"]
    assert params["obs.loggers"] == '["wandb", "mlflow", "tensorboard"]'
    logged = client.download_artifacts(run_id, "config.yaml", str(run / "downloaded"))
    resumed = yaml.safe_load(Path(logged).read_text())
    assert resumed["run"]["steps"] == 5  # the artifact is the resumed run's config


def test_tensorboard_is_still_written(run: Path) -> None:
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


# ------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(("logger", "extra"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_logger_whose_package_is_missing_is_one_line_before_anything_is_written(
    logger: str,
    extra: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, logger, None)  # import fails as if not installed
    run_dir = tmp_path / "run"
    code = main(["train", f"obs.loggers=[{logger}]", f"run.run_dir={run_dir}"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"stalebound train: obs.loggers=['{logger}']: {logger} needs the {logger} package, which "
        f"is not installed; install it with pip install 'stalebound[{extra}]', or remove "
        f"{logger}\n"
    )
    assert not run_dir.exists()


def test_a_logger_named_twice_is_refused() -> None:
    with pytest.raises(Exception, match=r"obs.loggers=.*names wandb twice; name each logger once"):
        load_config(overrides=["obs.loggers=[wandb,tensorboard,wandb]"])


# ---------------------------------------------------------------------- the RunLogger's hook


class Recorder:
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


def test_the_run_logger_hands_each_step_to_its_loggers_and_closes_them(tmp_path: Path) -> None:
    recorder = Recorder()
    with RunLogger(tmp_path, tensorboard=False, loggers=[recorder]) as logger:
        logger.log_step({"reward_mean": 0.5, "loss": math.nan}, version=1, staleness=[0, 2])
        logger.log_step({"reward_mean": 0.7}, version=2)
        assert not recorder.closed
    assert recorder.closed
    (step1, first), second = recorder.steps
    assert step1 == 1 and first["reward_mean"] == 0.5 and math.isnan(first["loss"])
    assert (first["staleness_mean"], first["staleness_max"], first["version"]) == (1.0, 2.0, 1)
    assert second == (2, {"reward_mean": 0.7, "version": 2})

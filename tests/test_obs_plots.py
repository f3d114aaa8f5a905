"""PNG plots from a run directory, and the ``stalebound plot`` command."""

from __future__ import annotations

import argparse
import random
import struct
import subprocess
import sys
from collections.abc import Hashable
from pathlib import Path

import pytest

from stalebound import StalenessBuffer
from stalebound.obs import RunLogger, buffer_rows

pytest.importorskip("matplotlib")

from stalebound.obs import cli as obs_cli
from stalebound.obs.plots import (
    BUFFER_TIMELINE_PNG,
    REWARD_VS_STEP_PNG,
    REWARD_VS_TIME_PNG,
    STALENESS_PNG,
    plot_run,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_run(run_dir: Path, steps: int = 12, seed: int = 0) -> None:
    """A run driven through a real StalenessBuffer with random completion order and a virtual clock."""
    rng = random.Random(seed)
    buf = StalenessBuffer(batch_size=4, staleness=2, buffer_size=6)
    in_flight: list[Hashable] = []
    next_id, t = 0, 0.0
    with RunLogger(run_dir, tensorboard=False) as logger:
        for step in range(1, steps + 1):
            while buf.try_reserve(next_id) is not None:
                in_flight.append(next_id)
                next_id += 1
            rng.shuffle(in_flight)
            while not buf.ready():
                buf.occupy(in_flight.pop())
                t += rng.uniform(0.05, 0.2)
                logger.log_buffers(t, buf.version, buffer_rows(buf))
            batch = buf.consume()
            for gid in batch.aborted:
                in_flight.remove(gid)
            reward = min(1.0, 0.1 + 0.06 * step + rng.uniform(-0.05, 0.05))
            logger.log_step(
                {"reward_mean": reward, "trajectories_per_s": 30.0 + step},
                version=buf.version,
                staleness=batch.staleness(),
                wall_time=t,
            )


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plots_are_valid_pngs_of_the_run(tmp_path: Path) -> None:
    synthetic_run(tmp_path)
    written = plot_run(tmp_path)
    names = {p.name for p in written}
    assert names == {REWARD_VS_TIME_PNG, REWARD_VS_STEP_PNG, STALENESS_PNG, BUFFER_TIMELINE_PNG}
    for path in written:
        assert path.parent == tmp_path
        width, height = png_size(path)
        assert width >= 600 and height >= 300
        assert path.stat().st_size > 10_000  # drawn content, not a blank canvas


def test_plots_go_to_another_directory_and_missing_data_is_skipped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLogger(run, tensorboard=False) as logger:
        logger.log_step({"loss": 1.0})
        logger.log_step({"loss": 0.5})
    out = tmp_path / "plots"
    assert plot_run(run, out) == []
    synthetic_run(tmp_path / "full", steps=4)
    written = plot_run(tmp_path / "full", out, reward_key="trajectories_per_s")
    assert {p.name for p in written} == {
        REWARD_VS_TIME_PNG,
        REWARD_VS_STEP_PNG,
        STALENESS_PNG,
        BUFFER_TIMELINE_PNG,
    }
    assert all(p.parent == out for p in written)


def test_imports_stay_lazy_and_plotting_leaves_pyplot_alone(tmp_path: Path) -> None:
    synthetic_run(tmp_path, steps=3)
    code = (
        "import sys\n"
        "import stalebound.obs\n"
        "heavy = ['matplotlib', 'tensorboard', 'prometheus_client', 'torch', 'numpy']\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "stalebound.obs.plot_run(sys.argv[1])\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[:2] == ["[]", "False"]
    assert (tmp_path / BUFFER_TIMELINE_PNG).exists()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stalebound")
    obs_cli.register(p.add_subparsers(dest="command", required=True))
    return p


def test_plot_command_draws_and_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    synthetic_run(tmp_path)
    args = parser().parse_args(["plot", str(tmp_path), "--out", str(tmp_path / "png")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 4
    assert "run summary: 12 steps" in out and "reward_mean" in out
    assert "staleness of trained data" in out
    assert (tmp_path / "png" / STALENESS_PNG).exists()


def test_plot_command_on_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(["plot", str(tmp_path / "nope")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "does not exist" in err


def test_plot_command_on_a_directory_without_records_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(["plot", str(tmp_path)])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (
        f"stalebound plot: run directory '{tmp_path}' holds no records (metrics.jsonl, "
        "staleness.jsonl, buffers.jsonl); pass the directory a run wrote\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_plot_command_names_the_metrics_when_the_reward_key_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    synthetic_run(tmp_path)
    args = parser().parse_args(["plot", str(tmp_path), "--reward-key", "rewrd_mean"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"stalebound plot: --reward-key='rewrd_mean': not a metric in {tmp_path}/metrics.jsonl; "
        "its metrics are "
    ), err
    assert "reward_mean" in err and not list(tmp_path.glob("*.png"))

"""Hostile input to the command line: each row is one invocation a careless or hostile user might
type. Every one must end in one clear error — exit code 2, a message that names the setting and
the value it was given — with no traceback, and nothing written: no run directory, no
``config.yaml``, no plot or trace file.

Rows run in-process through :func:`stalebound.cli.main` (an exception escaping it fails the test);
the read-only-directory rows run in a subprocess inside a private mount namespace, where even root
cannot write (skipped where that is not available).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalebound.cli import main as cli_main
from stalebound.config.cli import main as config_main

LONG = "a" * 300  # one name past the 255 bytes a file system allows


def files(tmp: Path) -> None:
    """The hostile files every row may name, in ``tmp`` (the working directory)."""
    (tmp / "nonutf8.jsonl").write_bytes(b'{"question": "1+1", "answer": "\xff"}\n')
    (tmp / "binary.bin").write_bytes(bytes(reversed(range(256))) * 8)
    (tmp / "badjson").mkdir()
    (tmp / "badjson" / "config.json").write_text("{not json")
    (tmp / "nomodeltype").mkdir()
    (tmp / "nomodeltype" / "config.json").write_text("{}")
    (tmp / "runs").mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "damaged_run").mkdir()
    (tmp / "damaged_run" / "metrics.jsonl").write_bytes(bytes(reversed(range(256))))
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    (tmp / "bomb.yaml").write_text("\n".join(lines) + "\n")
    (tmp / "keys.yaml").write_text("".join(f"u{i:05d}: {i}\n" for i in range(20_000)))
    with (tmp / "huge.yaml").open("w") as f:
        f.truncate(50 << 20)
    header = {"type": "header", "format": "stalebound-trace", "version": 1, "source": "runtime"}
    record = {"type": "trajectory", "prompt_id": 0, "start": 0.0, "end": 1.0, "tokens": 8}
    for name, head, rec in [
        ("nan_trace.jsonl", {**header, "group_size": math.nan}, record),
        ("zero_trace.jsonl", {**header, "group_size": 0}, record),
        ("inf_meta_trace.jsonl", {**header, "meta": {"staleness": math.inf}}, record),
        ("nan_start_trace.jsonl", header, {**record, "start": math.nan}),
    ]:
        (tmp / name).write_text(json.dumps(head) + "\n" + json.dumps(rec) + "\n")
    (tmp / "empty_run").mkdir()
    (tmp / "metrics_run").mkdir()
    (tmp / "metrics_run" / "metrics.jsonl").write_text(
        '{"step": 1, "version": 1, "wall_time": 1.0, "reward_mean": 0.5}\n'
    )
    (tmp / "oldrun" / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp / "oldrun" / "config.yaml").write_text("run: {steps: 3}\n")


NEVER = "never"  # the run directory every train row names: it must not appear
TRAIN = ["train", f"run.run_dir={NEVER}", "run.live=false", "engine.cache_dir=models"]

# (id, argv, a substring the error must hold — naming the setting and its value)
ROWS = [
    (
        "prompt file not UTF-8",
        [*TRAIN, "task.data_path=nonutf8.jsonl"],
        "task.data_path='nonutf8.jsonl' line 1: not UTF-8 text (byte 31 is 0xff",
    ),
    (
        "prompt file binary",
        [*TRAIN, "task.data_path=binary.bin"],
        "task.data_path='binary.bin' line 1: not UTF-8 text",
    ),
    ("prompt file named too long", [*TRAIN, f"task.data_path={LONG}"], "File name too long"),
    ("no new tokens", [*TRAIN, "task.max_new_tokens=0"], "task.max_new_tokens=0: must be"),
    (
        "model config.json not JSON",
        [*TRAIN, "engine.model_path=badjson"],
        "engine.model_path='badjson': its config.json is not valid JSON",
    ),
    (
        "model config.json without a model type",
        [*TRAIN, "engine.model_path=nomodeltype"],
        "engine.model_path='nomodeltype': its config.json does not load",
    ),
    (
        "model path too long",
        [*TRAIN, f"engine.model_path={LONG}"],
        "cannot read its config.json (File name too long)",
    ),
    (
        "cache directory too long",
        [*TRAIN, f"engine.cache_dir={LONG}"],
        "engine.cache_dir='aaaa",
    ),
    (
        "cache directory under a file",
        [*TRAIN, "engine.cache_dir=afile/models"],
        "engine.cache_dir='afile/models': cannot write there",
    ),
    (
        "run directory name of 300 characters",
        ["train", f"run.run_dir=runs/{LONG}", "run.live=false", "engine.cache_dir=models"],
        "run.run_dir='runs/aaaa",
    ),
    ("resume from a name too long", ["train", f"resume=runs/{LONG}"], "resume='runs/aaaa"),
    ("audit a name too long", ["audit", f"runs/{LONG}"], "run_dir='runs/aaaa"),
    ("audit nothing", ["audit", "nowhere"], "run_dir='nowhere': cannot read it"),
    (
        "config file: an alias bomb",
        [*TRAIN, "bomb.yaml"],
        "config=bomb.yaml: holds more than 10,000 values",
    ),
    (
        "config file: 20,000 keys",
        [*TRAIN, "keys.yaml"],
        "config=keys.yaml: holds more than 10,000 values",
    ),
    (
        "config file: 50 MiB",
        [*TRAIN, "huge.yaml"],
        "config=huge.yaml: 50 MiB, more than the 1 MiB",
    ),
    (
        "config file: binary",
        [*TRAIN, "--config", "binary.bin"],
        "config=binary.bin: not UTF-8 text",
    ),
    (
        "workload binary",
        ["simulate", "--workload", "binary.bin", "--steps", "5"],
        "workload='binary.bin': not UTF-8 text",
    ),
    (
        "workload: an alias bomb",
        ["simulate", "--workload", "bomb.yaml", "--steps", "5"],
        "workload='bomb.yaml': holds more than 10,000 values",
    ),
    (
        "workload: 50 MiB",
        ["simulate", "--workload", "huge.yaml", "--steps", "5"],
        "workload='huge.yaml': 50 MiB, more than the 1 MiB",
    ),
    (
        "replay binary",
        ["simulate", "--replay", "binary.bin", "--steps", "5"],
        "replay='binary.bin' line 1: not UTF-8 text",
    ),
    (
        "record into a directory",
        ["simulate", "--record", "runs", "--steps", "5", "--policy", "buffer"],
        "record='runs': is a directory",
    ),
    (
        "record with a name too long",
        ["simulate", "--record", LONG, "--steps", "5", "--policy", "buffer"],
        "cannot write there (File name too long)",
    ),
    ("plot a name too long", ["plot", f"runs/{LONG}"], "run directory 'runs/aaaa"),
    (
        "plot a binary metrics file",
        ["plot", "damaged_run"],
        "damaged_run/metrics.jsonl line 1: not UTF-8 text",
    ),
    (
        "replay: a group size of NaN",
        ["simulate", "--replay", "nan_trace.jsonl", "--steps", "5"],
        "trace nan_trace.jsonl line 1: group_size=nan: must be a whole number ≥ 1",
    ),
    (
        "replay: a group size of 0",
        ["simulate", "--replay", "zero_trace.jsonl", "--steps", "5"],
        "trace zero_trace.jsonl line 1: group_size=0: must be a whole number ≥ 1",
    ),
    (
        "replay: an infinite number in the header",
        ["simulate", "--replay", "inf_meta_trace.jsonl", "--steps", "5"],
        "line 1: meta.staleness=inf: must be a finite number",
    ),
    (
        "replay: an episode starting at NaN",
        ["simulate", "--replay", "nan_start_trace.jsonl", "--steps", "5"],
        "line 2: start=nan, end=1.0: must be finite seconds",
    ),
    (
        "plot an empty directory",
        ["plot", "empty_run"],
        "run directory 'empty_run' holds no records (metrics.jsonl, staleness.jsonl",
    ),
    (
        "plot a reward key the records do not have",
        ["plot", "metrics_run", "--reward-key", "rewrd_mean"],
        "--reward-key='rewrd_mean': not a metric in metrics_run/metrics.jsonl; its metrics are "
        "reward_mean",
    ),
    (
        "a batch of a billion groups",
        [*TRAIN, "rollout.consumer_batch_size=1000000000"],
        "rollout.consumer_batch_size=1000000000: the run would hold about ",
    ),
    (
        "groups of a hundred million",
        [*TRAIN, "rollout.group_size=100000000"],
        "rollout.group_size=100000000: the run would hold about ",
    ),
    (
        "a run directory a resume would ignore",
        ["train", "--resume", "oldrun/checkpoints/step-000002", f"run.run_dir={NEVER}"],
        "run.run_dir='never': a resumed run continues in its own directory",
    ),
    (
        "plot under a file",
        ["simulate", "--plot", "afile/plots", "--steps", "5", "--policy", "buffer"],
        "plot='afile/plots': cannot write there (Not a directory)",
    ),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    files(tmp)
    return tmp


def _written(tmp: Path) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


@pytest.mark.parametrize(("argv", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_hostile_invocation_is_one_clear_error_and_writes_nothing(
    argv: list[str],
    expected: str,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(workdir)
    before = _written(workdir)
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err, err
    assert "Traceback" not in err
    assert err.count("\n") <= 2, err  # one message (its problems), not a log
    assert _written(workdir) == before, "something was written"
    assert not (workdir / NEVER).exists()


def test_the_config_printer_refuses_the_same_files(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(workdir)
    assert config_main(["bomb.yaml", "keys.yaml", "huge.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("3 configuration problems:")
    for name in ("bomb.yaml", "keys.yaml", "huge.yaml"):
        assert f"config={name}: " in err


def _read_only(directory: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``python -m stalebound ARGV`` with ``directory`` mounted read-only (root included)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return subprocess.run(
            [sys.executable, "-m", "stalebound", *argv], capture_output=True, text=True, timeout=120
        )
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("root without user namespaces: cannot make a directory read-only")
    lock = f"mount --bind {directory} {directory} && mount -o remount,bind,ro {directory}"
    cmd = f'{lock} && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd, "sh", sys.executable, "-m", "stalebound", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", "run.live=false", "engine.cache_dir={ro}/models", "run.run_dir={tmp}/run"],
            "engine.cache_dir='{ro}/models': cannot write there (",
        ),
        (
            ["train", "run.live=false", "engine.cache_dir={tmp}/models", "run.run_dir={ro}/run"],
            "run.run_dir='{ro}/run': cannot write there (",
        ),
        (
            ["simulate", "--plot", "{ro}/plots", "--steps", "5", "--policy", "buffer"],
            "plot='{ro}/plots': cannot write there (",
        ),
        (
            ["simulate", "--record", "{ro}/t.jsonl", "--steps", "5", "--policy", "buffer"],
            "record='{ro}/t.jsonl': cannot write there (",
        ),
    ],
    ids=["cache_dir", "run_dir", "plot", "record"],
)
def test_a_read_only_directory_is_refused_before_anything_runs(
    argv: list[str], expected: str, tmp_path: Path
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    argv = [a.format(ro=ro, tmp=tmp_path) for a in argv]
    done = _read_only(ro, argv)
    assert done.returncode == 2, done.stderr
    assert expected.format(ro=ro) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "models").exists()
    assert "stalebound simulate:" in done.stderr or "stalebound train:" in done.stderr


def test_the_version_is_one_flag_away(capsys: pytest.CaptureFixture[str]) -> None:
    from stalebound import __version__

    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"stalebound {__version__}\n"


def test_every_command_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    from stalebound.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"train", "bench", "ablate", "audit", "walkthrough", "plot", "simulate"} <= set(commands)
    for name, sub in commands.items():
        assert sub.description, f"stalebound {name} -h has no description"
        try:
            code = cli_main([name, "-h"])
        except SystemExit as exit_:
            code = exit_.code
        out = capsys.readouterr().out
        assert code == 0, name
        paragraphs = [p for p in out.split("\n\n") if p.strip()]
        assert paragraphs[0].startswith(f"usage: stalebound {name}"), out
        assert len(paragraphs) > 1 and not paragraphs[1].lstrip().startswith("positional"), out


BLOCK_TORCH = """
import importlib.abc, sys

class Missing(importlib.abc.MetaPathFinder):  # as if torch were not installed
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
from stalebound.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv", [["train", "run.live=false"], ["bench", "--staleness", "2", "--target", "1"]]
)
def test_a_command_that_needs_torch_names_the_extra_to_install(
    argv: list[str], tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"stalebound {argv[0]}: needs torch, which is not installed; install it with the extra: "
        "pip install 'stalebound[torch]'\n"
    )
    assert list(tmp_path.iterdir()) == []

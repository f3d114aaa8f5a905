"""The vLLM server launcher's failure paths and command line (no vLLM needed; tests/vllm starts a
real server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from stalebound.core.errors import ConfigError
from stalebound.engines.vllm_server import (
    VLLMServerError,
    find_vllm_python,
    register,
    start_vllm_server,
)


def test_missing_environment_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"scripts/vllm_env\.sh"):
        find_vllm_python(tmp_path / "no-python")


def test_a_server_that_exits_at_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    # This interpreter has no vllm module: the server process exits at once.
    with pytest.raises(VLLMServerError, match=r"exited with code 1(.|\n)*No module named"):
        start_vllm_server(
            model, 0, python=sys.executable, log_path=tmp_path / "log", startup_timeout=60
        )


def test_not_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        start_vllm_server(tmp_path, 0, python=sys.executable)


def test_serve_vllm_command_line() -> None:
    parser = argparse.ArgumentParser(prog="stalebound")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve-vllm", "--port", "0", "--model", "/m"])
    assert args.port == 0 and args.model == "/m" and args.host == "127.0.0.1"
    assert args.dtype == "float32" and not args.weight_ipc
    assert callable(args.func)
    args = parser.parse_args(["serve-vllm", "--model", "/m", "--dtype", "bfloat16", "--weight-ipc"])
    assert args.dtype == "bfloat16" and args.weight_ipc


def test_serve_vllm_refuses_a_directory_that_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalebound.cli import main

    assert main(["serve-vllm", "--model", str(tmp_path), "--python", sys.executable]) == 2
    assert "not a Hugging Face checkpoint directory (no config.json)" in capsys.readouterr().err

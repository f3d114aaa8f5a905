"""Servers checked before a run starts anything, and every wait for them ended by a signal.

``stalebound train engine.kind=vllm`` probes each server's health endpoint before it loads the
model: a URL where nothing answers is a configuration error (exit 2, nothing written); a server
that is still starting gets ``engine.startup_timeout_s``. SIGTERM/SIGINT end that wait, and the
engines' own start after the warm start, at once. The servers here are small HTTP servers written
in the test (no vLLM needed); the order of events is driven by what they see, never by a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")

from stalebound.cli import main
from stalebound.engines.endpoints import check_endpoints


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """A server on 127.0.0.1 that answers ``GET /health`` with 200, and ``GET /v1/models`` only
    once ``release`` is set (``asked`` is set when that request arrives)."""

    def __init__(self, port: int = 0) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.paths.append(self.path)
                if self.path == "/v1/models":
                    server.asked.set()
                    server.release.wait(120)
                body = json.dumps({}).encode() if self.path == "/health" else b"{}"
                try:
                    self.send_response(200 if self.path == "/health" else 503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    pass

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_a_url_where_nothing_answers_is_one_problem_naming_it_and_the_fix() -> None:
    port = free_port()
    problems = check_endpoints([f"http://127.0.0.1:{port}"], timeout_s=2.0)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"engine.urls[0]='http://127.0.0.1:{port}': no vLLM server answers there (GET /health: "
        "ConnectError: "
    )
    assert problems[0].endswith(
        f"); start one with `stalebound serve-vllm --port {port}` (or make test-vllm), or fix "
        "engine.urls; if it is still starting, wait for it with engine.startup_timeout_s=300"
    )


def test_healthy_servers_pass_and_each_dead_one_is_named(server: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert check_endpoints([server.url, server.url]) == []
    problems = check_endpoints([server.url, dead], kind="sglang", timeout_s=2.0)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"engine.urls[1]={dead!r}: no SGLang server answers there (GET /health: "
    )
    assert "sglang.launch_server --model-path ... --port" in problems[0]


def test_a_server_that_starts_during_the_wait_passes() -> None:
    port = free_port()
    told: list[str] = []
    started: list[Server] = []

    def start_it(message: str) -> None:  # the first probe failed: now the server comes up
        told.append(message)
        started.append(Server(port))

    try:
        assert check_endpoints([f"http://127.0.0.1:{port}"], wait_s=60, on_wait=start_it) == []
    finally:
        for s in started:
            s.close()
    assert len(told) == 1 and told[0].startswith(
        f"engine.urls[0]='http://127.0.0.1:{port}': no vLLM server answers yet (GET /health: "
    )
    assert told[0].endswith("waiting up to 60 s for it to start")
    assert started[0].paths == ["/health"]


def test_a_server_that_never_starts_is_reported_after_the_wait() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    (problem,) = check_endpoints([url], timeout_s=1.0, wait_s=0.3)
    assert "(GET /health for 0.3 s: ConnectError: " in problem
    assert problem.endswith("if it is still starting, give it longer with engine.startup_timeout_s")


def train_args(run_dir: Path, models: Path, url: str, *extra: str) -> list[str]:
    return [
        "train",
        "engine.kind=vllm",
        f"engine.urls=[{url}]",
        f"run.run_dir={run_dir}",
        f"engine.cache_dir={models}",
        "run.live=false",
        "run.eval_prompts=4",
        "run.plots=false",
        "run.tensorboard=false",
        *extra,
    ]


def test_train_against_a_dead_url_exits_2_before_it_loads_or_writes_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    run_dir, models = tmp_path / "run", tmp_path / "models"
    assert main(train_args(run_dir, models, f"http://127.0.0.1:{port}")) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no warm start, no model
    (line,) = err.splitlines()
    assert line.startswith(
        f"stalebound train: engine.urls[0]='http://127.0.0.1:{port}': no vLLM server answers "
        "there (GET /health: "
    )
    assert f"start one with `stalebound serve-vllm --port {port}`" in line
    assert not run_dir.exists() and not models.exists()  # nothing written, no model built


class Train:
    """``stalebound train`` in its own process; ``lines`` are its output so far."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stalebound", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []

    def until(self, seen: Callable[[str], bool]) -> str:
        """Read the output up to the first line ``seen`` accepts (failing if it ends first)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if seen(line):
                return line
        raise AssertionError("the run ended first:\n" + "\n".join(self.lines))

    def finish(self, timeout: float) -> tuple[int, str]:
        """The exit code and the rest of the output; a run still going after ``timeout`` seconds
        is a failure (the wait did not end), not a slow machine: it would go on for minutes."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest, _ = self.proc.communicate()
            raise AssertionError(
                f"still running {timeout} s after the signal:\n" + "\n".join(self.lines) + rest
            ) from None
        return self.proc.returncode, "\n".join(self.lines) + "\n" + rest

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.mark.slow
def test_sigterm_ends_the_wait_for_a_server_that_is_not_there(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run_dir, models = tmp_path / "run", tmp_path / "models"
    train = Train(train_args(run_dir, models, url, "engine.startup_timeout_s=3600"))
    try:
        waiting = train.until(lambda line: "waiting up to 3600 s" in line)
        assert waiting.startswith(f"engine.urls[0]='{url}': no vLLM server answers yet")
        train.proc.send_signal(signal.SIGTERM)
        code, output = train.finish(timeout=30)
    finally:
        train.kill()
    assert code == 128 + signal.SIGTERM, output
    assert output.rstrip().endswith(
        "stalebound train: SIGTERM received: interrupted before the run started; nothing was "
        "written"
    )
    assert "Traceback" not in output
    assert not run_dir.exists() and not models.exists()


@pytest.mark.slow
def test_sigterm_ends_the_engines_start_after_the_warm_start(
    tmp_path: Path, server: Server
) -> None:
    # The server passes the check, then never answers the engine's GET /v1/models: the start
    # waits on it (for the read timeout, 300 s) until the signal.
    run_dir, models = tmp_path / "run", tmp_path / "models"
    train = Train(train_args(run_dir, models, server.url, "train.warm_start_steps=2"))
    try:
        assert server.asked.wait(240), "the engine never asked for the models:\n" + "\n".join(
            train.lines
        )
        train.proc.send_signal(signal.SIGTERM)
        code, output = train.finish(timeout=60)
    finally:
        train.kill()
    assert code == 128 + signal.SIGTERM, output
    assert (
        f"stalebound train: SIGTERM received: stopped at once after step 0; no checkpoint was "
        f"written yet, so start it again from the beginning with: stalebound train "
        f"resume={run_dir}"
    ) in output
    assert "Traceback" not in output
    assert "stopping after this step" not in output
    assert not (run_dir / "checkpoints").exists() and (run_dir / "config.yaml").is_file()

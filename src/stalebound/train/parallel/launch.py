"""Trainer ranks as processes on this machine, started the way ``torchrun`` starts them.

:class:`ProcessRanks` spawns one process per rank (``multiprocessing`` with ``spawn``), each with
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``,
and talks to each over a pipe: a call is sent to every rank, and the driver waits for the replies
and for the processes' exits together, in slices of a second, so a signal interrupts the wait
and a rank that dies is noticed at once. A rank's weights come back through shared memory
(torch's tensor sharing), not copied through the pipe.

Like the engine workers, the ranks ignore the terminal's Ctrl-C (the job finishes its step and
checkpoints first) and end with the job: their pipe reads end-of-file when it dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalebound.train.parallel.driver import ShardedTrainer, StoppingRanks
from stalebound.train.parallel.rank import RankSpec, TrainerRank

if TYPE_CHECKING:
    from stalebound.config import StaleboundConfig

__all__ = ["ProcessRanks", "free_port", "launch_ranks"]

_log = logging.getLogger(__name__)

_GRACE_S = 60.0
"""How much longer than the process group's timeout the driver waits for a reply: a rank stuck
in a collective fails by itself first and says why."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the process group's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
    return port


def rank_main(conn: Connection, rank: int, spec: RankSpec, device: str, master: str) -> None:
    """Entry point of a rank process: join the group, then serve calls until told to close."""
    from stalebound.engines._worker import leave_the_terminal

    leave_the_terminal()
    import torch.multiprocessing  # noqa: F401  (tensors sent back travel through shared memory)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    body = TrainerRank(rank, spec, device)
    request: Any = ("join", (master,))
    while True:
        method, args = request
        if method == "close":
            body.close()
            conn.send(("ok", None))
            return
        try:
            result = getattr(body, method)(*args)
        except BaseException as exc:
            lines = traceback.format_exception_only(type(exc), exc)
            conn.send(("error", "".join(lines).strip(), traceback.format_exc()))
            return
        conn.send(("ok", result))
        try:
            request = conn.recv()
        except EOFError:  # the job is gone
            body.close()
            return


class ProcessRanks(StoppingRanks):
    """``spec.world_size`` rank processes on this machine (see the module docstring);
    ``devices[r]`` is rank r's device."""

    def __init__(self, spec: RankSpec, devices: Sequence[str]) -> None:
        import torch.multiprocessing  # noqa: F401  (receives rank 0's weights from shared memory)

        from stalebound.engines._worker import terminal_signals_blocked

        self.world_size = spec.world_size
        self._timeout_s = spec.config.rank_timeout_s + _GRACE_S
        master = f"127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        try:
            for r in range(self.world_size):
                conn, child = context.Pipe(duplex=True)
                proc = context.Process(
                    target=rank_main,
                    args=(child, r, spec, devices[r], master),
                    name=f"stalebound-trainer-rank{r}",
                    daemon=True,
                )
                with terminal_signals_blocked():  # the rank unblocks them once it ignores them
                    proc.start()
                child.close()
                self._conns.append(conn)
                self._procs.append(proc)
            self._replies()  # every rank joined and built its share of the model
        except BaseException:
            self._kill()
            raise

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        self._check_open()
        for r, conn in enumerate(self._conns):
            try:
                conn.send((method, args[r]))
            except OSError:
                self._fail(r, f"its process is gone ({self._exit(r)})")
        return self._replies()

    def weights(self, payload: Any) -> Mapping[str, Any]:
        state: Mapping[str, Any] = payload
        return state

    def _exit(self, r: int) -> str:
        proc = self._procs[r]
        proc.join(1.0)
        return f"the process exited (code {proc.exitcode})"

    def _replies(self) -> list[Any]:
        """Every rank's reply, or stop the group at the first failure and name the rank."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self._timeout_s
        by_object: dict[Any, int] = {}
        for r, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            by_object[conn] = r
            by_object[proc.sentinel] = r
        while len(replies) < self.world_size:
            waiting = [
                o for o, r in by_object.items() if r not in replies
            ]  # replies first: a rank that answered and exited is not a failure
            ready = wait(waiting, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for obj in sorted(ready, key=lambda o: not isinstance(o, Connection)):
                r = by_object[obj]
                if r in replies:
                    continue
                if isinstance(obj, Connection):
                    try:
                        status, *rest = obj.recv()
                    except (EOFError, OSError):
                        self._fail(r, self._exit(r))
                    if status == "error":
                        _log.error("trainer rank %d:\n%s", r, rest[1])
                        self._fail(r, rest[0])
                    replies[r] = rest[0]
                else:
                    self._fail(r, self._exit(r))
            if len(replies) < self.world_size and time.monotonic() >= deadline:
                late = min(r for r in range(self.world_size) if r not in replies)
                self._fail(late, f"no reply within {self._timeout_s:.0f} s")
        return [replies[r] for r in range(self.world_size)]

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()

    def close(self) -> None:
        """Leave the process group and stop the rank processes. Idempotent."""
        if self._closed is not None:
            return
        self._closed = "closed"
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("close", ()))
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()


def launch_ranks(
    cfg: StaleboundConfig, model_path: Path, pad_token_id: int, version: int
) -> ShardedTrainer:
    """``train.world_size`` rank processes on the checkpoint at ``model_path`` (rank r on
    :func:`~stalebound.train.parallel.settings.rank_device`), behind a trainer's surface."""
    from stalebound.train.parallel.settings import rank_device

    t = cfg.train
    spec = RankSpec(str(model_path), t, pad_token_id, version, t.world_size)
    devices = [rank_device(cfg, r) for r in range(t.world_size)]
    return ShardedTrainer(ProcessRanks(spec, devices), t, version=version)

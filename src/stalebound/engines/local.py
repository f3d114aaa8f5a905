"""The embedded local engine: a Hugging Face causal LM served with continuous batching.

:class:`LocalEngine` implements :class:`~stalebound.engines.protocol.MigratableEngine`. The model
runs in **its own worker process** (``multiprocessing`` with the ``spawn`` start method), so
generation gets a core of its own beside a trainer in the calling process instead of competing for
the GIL. The asyncio-facing client talks to the worker over one duplex pipe: a single sender thread
writes (so the event loop never blocks on a full pipe, and commands keep their order), and a reader
thread resolves ``concurrent.futures`` futures the coroutines await.

The worker ignores a terminal's Ctrl-C: it runs in a session of its own and ignores SIGINT, so
the process that owns the engine decides what an interrupt means (the training job finishes its
step, checkpoints and closes the engine). It ends when that process does (its pipe reads
end-of-file) or when :meth:`LocalEngine.close` stops it.

Decoding (in the worker, see ``_worker.py``):

* **Continuous batching.** Between two decode steps the worker takes every command that arrived:
  new requests join the running batch (up to ``max_batch_size``; the rest wait, oldest
  ``priority_version`` first), finished, aborted and exported requests leave it.
* **Ragged KV cache by left padding, in cohorts of like length.** Each request is prefilled on
  its own (requests of equal context length are prefilled together, so a prefill never needs
  padding). The running requests are held in cohorts, each one batch whose KV cache is left-padded
  with zeros to its longest row; a decode step runs one forward pass per cohort, with a 2-D
  attention mask that hides the padding and explicit per-row position ids, so each row computes
  exactly what it would alone (up to float rounding of batched matrix products). Cohorts of like
  cache length merge (the shorter cache left-padded, the rows concatenated) as long as the padding
  that adds costs less than another forward pass (on a CPU; on an accelerator every request joins
  one cohort), and at most 8 are kept. So a straggler with a long context does not pad the short
  rows decoding beside it to its length — on the CPU, a batch of 256 rows padded to 300 positions
  costs about ten times the two passes that keep them apart. Rows that leave are dropped with
  ``index_select``, and columns that became padding in every row of a cohort are trimmed. Chosen
  over re-batching per step (which re-copies or recomputes every cache each token) and over a paged
  cache (which needs custom attention kernels): it reuses the model's own attention unchanged,
  hence works for any HF causal LM that accepts a ``DynamicCache``, and copies a cache only when
  cohorts merge.
* **Log-probabilities** are the raw model's: ``log_softmax(logits)`` at temperature 1 before top-p,
  of the sampled token, under the weights that sampled it — what the trainer recomputes.
* **Sampling randomness** of token ``i`` of a request is a hash of ``(seed, i)``, so results do not
  depend on batching or on which engine instance runs the request: migrated and resubmitted
  requests continue their exact random stream.

Weight updates (``update_weights(source, version)``): the worker takes the update between two
tokens, checks the new state dict against the model (names and shapes; on a mismatch it raises and
nothing changes), copies it into the parameters in place, and sets the version. A state dict
travels over the pipe as one blob of raw tensor bytes plus an index (the worker views tensors
straight out of the blob; ``torch.save``/``torch.load`` pickling was several times slower); a
checkpoint directory is loaded by the worker itself. Then, by ``interrupt_mode``:

* ``"continue"`` (default, partial rollout): in-flight requests go on with the new weights from the
  next token. Their KV cache of earlier tokens was computed by the old weights and is kept; every
  token records the version that sampled it.
* ``"resubmit"`` (AReaL's interruptible generation): in-flight requests are interrupted and
  resubmitted as prompt + partial output, so the new weights recompute the whole KV cache before
  the next token. The caller still gets one response per request; ``response.resubmits`` counts
  the restarts.

The stall each update caused (from reading the update to being ready for the next token) is kept
in :meth:`LocalEngine.statistics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

from stalebound.core.errors import ConfigError, ProtocolError
from stalebound.engines._worker import terminal_signals_blocked, uniform, worker_main
from stalebound.engines.devices import device_problems, resolve_device
from stalebound.engines.protocol import (
    Continuation,
    EngineClosedError,
    GenerateRequest,
    GenerateResponse,
    WeightSource,
)

__all__ = ["EngineStatistics", "InterruptMode", "LocalEngine"]

_log = logging.getLogger(__name__)

InterruptMode = Literal["continue", "resubmit"]
_MODES: Final[tuple[str, ...]] = ("continue", "resubmit")
_PAUSES_KEPT: Final[int] = 256


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of an engine's counters (cumulative since it started)."""

    version: int
    in_flight: int
    submitted: int
    finished_stop: int
    finished_length: int
    aborted: int
    migrated_out: int
    migrated_in: int
    resubmits: int
    output_tokens: int
    weight_updates: int
    pause_ms: tuple[float, ...]
    """The generation stall of each recent weight update, in milliseconds (oldest first)."""
    weight_updates_on_device: int = 0
    """Weight updates handed over GPU to GPU (CUDA IPC), without a copy through the CPU."""


@dataclass(slots=True)
class _Counts:
    """The engine's running counters, named as :class:`EngineStatistics` reports them."""

    submitted: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    aborted: int = 0
    migrated_out: int = 0
    migrated_in: int = 0
    resubmits: int = 0
    output_tokens: int = 0
    weight_updates: int = 0
    weight_updates_on_device: int = 0


@dataclass(frozen=True, slots=True)
class _WorkerInfo:
    vocab_size: int
    max_positions: int
    eos_ids: tuple[int, ...]
    pid: int
    device: str


def _derive_seed(engine_seed: int, request_id: str) -> int:
    # A request's own sampling seed when it gives none: distinct per id, reproducible per engine seed.
    return int(uniform(engine_seed, zlib.crc32(request_id.encode())) * (1 << 53))


def _pack_state_dict(state: Mapping[str, Any]) -> tuple[bytes, tuple[tuple[Any, ...], ...]]:
    """One contiguous blob of raw tensor bytes plus an index ``(name, dtype, shape, offset,
    nbytes)``: the worker views tensors straight out of it, much faster than ``torch.load``."""
    import torch

    chunks, index, offset = [], [], 0
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ProtocolError(
                f"update_weights: state[{name!r}] is a {type(value).__name__}, not a tensor; "
                "pass model.state_dict()"
            )
        flat = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        dtype = str(value.dtype).removeprefix("torch.")
        index.append((name, dtype, tuple(value.shape), offset, flat.numel()))
        chunks.append(flat)
        offset += flat.numel()
    blob = torch.cat(chunks).numpy().tobytes() if chunks else b""
    return blob, tuple(index)


def _on_device(state: Mapping[str, Any], device: str) -> bool:
    """Whether every tensor of ``state`` is on the worker's CUDA ``device``."""
    import torch

    if not device.startswith("cuda") or not state:
        return False
    want = torch.device(device)
    index = want.index if want.index is not None else torch.cuda.current_device()
    return all(
        isinstance(v, torch.Tensor) and v.is_cuda and v.device.index == index
        for v in state.values()
    )


def _resolve(future: concurrent.futures.Future[Any], value: Any) -> None:
    if not future.done():  # the awaiting coroutine may have been cancelled
        future.set_result(value)


def _reject(future: concurrent.futures.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class LocalEngine:
    """The embedded engine: serves the HF checkpoint at ``model_path`` from a worker process.

    Construction starts the worker and returns at once; calls wait until the model is loaded (or
    call :meth:`wait_ready`). ``version`` is the version of the weights in the checkpoint. ``seed``
    seeds requests that bring none. Close with :meth:`close` (or use ``with`` / ``async with``);
    afterwards every call raises :class:`EngineClosedError`, as do pending calls. With
    ``step_log`` the worker appends what its decode steps cost to that file
    (:mod:`stalebound.engines.steplog`; calibration reads it).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        version: int = 0,
        seed: int = 0,
        max_batch_size: int = 256,
        interrupt_mode: InterruptMode = "continue",
        num_threads: int = 1,
        name: str = "local",
        device: str = "cpu",
        dtype: str = "float32",
        step_log: str | os.PathLike[str] | None = None,
    ) -> None:
        problems = device_problems("engine", device, dtype)
        if not (Path(model_path) / "config.json").is_file():
            problems.append(
                f"model_path={str(model_path)!r}: no config.json there; pass a Hugging Face "
                "checkpoint directory (build_default_model(path) creates the default one)"
            )
        if max_batch_size < 1:
            problems.append(f"max_batch_size={max_batch_size!r}: must be >= 1")
        if interrupt_mode not in _MODES:
            problems.append(f"interrupt_mode={interrupt_mode!r}: must be one of {_MODES}")
        if num_threads < 1:
            problems.append(f"num_threads={num_threads!r}: must be >= 1")
        if problems:
            raise ConfigError(problems)
        self.name = name
        self._seed = seed
        self._version = version
        self._interrupt_mode: InterruptMode = interrupt_mode
        self._state_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[GenerateResponse]] = {}
        self._replies: dict[int, concurrent.futures.Future[Any]] = {}
        self._tokens = itertools.count()
        self._closed: str | None = None
        self._death: str | None = None
        self._counts = _Counts()
        self._pauses: deque[float] = deque(maxlen=_PAUSES_KEPT)
        self._ready: concurrent.futures.Future[_WorkerInfo] = concurrent.futures.Future()

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(
            target=worker_main,
            args=(
                child,
                str(model_path),
                version,
                max_batch_size,
                interrupt_mode,
                num_threads,
                resolve_device(device),
                dtype,
                None if step_log is None else str(step_log),
            ),
            name=f"stalebound-engine-{name}",
            daemon=True,
        )
        with terminal_signals_blocked():  # the worker unblocks them once it ignores them
            self._process.start()
        child.close()
        # Messages to the worker go through a queue to one sender thread, which writes whatever
        # has piled up as one message: a burst of submissions costs one pipe write, and the
        # event loop never blocks on the pipe nor hops to a thread pool per request.
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send_loop, name=f"stalebound-{name}-send", daemon=True
        )
        self._sender.start()
        self._reader = threading.Thread(
            target=self._read_loop, name=f"stalebound-{name}-read", daemon=True
        )
        self._reader.start()
        self._info_now: _WorkerInfo | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker has loaded the model (raises if it failed to)."""
        self._ready.result(timeout)

    @property
    def closed(self) -> bool:
        """Whether the engine was closed or its worker died."""
        return self._closed is not None

    @property
    def death(self) -> str | None:
        """Why the worker died (``"engine 'local0': the worker exited (code -9)"``); ``None``
        while it runs or after :meth:`close`."""
        return self._death

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker. Pending calls raise :class:`EngineClosedError`. Idempotent."""
        with self._state_lock:
            if self._closed is not None:
                return
            self._closed = f"engine {self.name!r} was closed"
        if self._ready.done():
            try:
                with self._send_lock:
                    self._conn.send(("shutdown",))
            except OSError:
                pass  # the worker is already gone
            self._process.join(timeout)
        else:
            self._process.kill()  # still loading the model: nothing in flight to finish
        if self._process.is_alive():
            _log.warning(
                "engine %r: worker did not exit in %.1f s, terminating", self.name, timeout
            )
            self._process.terminate()
            self._process.join(timeout)
        self._reader.join(timeout)
        self._conn.close()
        self._outbox.put(None)
        self._fail_all()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> LocalEngine:
        await self._info()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- the engine protocol ------------------------------------------------------------------

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate one sequence (see :class:`~stalebound.engines.protocol.InferenceEngine`)."""
        if not isinstance(request, GenerateRequest):
            raise ProtocolError(
                f"agenerate expects a GenerateRequest, got {type(request).__name__}; build one "
                "with GenerateRequest(request_id, input_ids, SamplingParams(...))"
            )
        if request.sampling.n != 1:
            raise ProtocolError(
                f"request {request.request_id!r}: sampling.n={request.sampling.n}; an engine "
                "call generates one sequence: expand it with stalebound.engines.split_n(request)"
            )
        return await self._submit(Continuation.of(request), migrated=False)

    async def abort(self, request_id: str) -> GenerateResponse | None:
        """Stop a request; returns its partial output (``finish_reason == "abort"``), or ``None``
        if no request with this id is in flight here."""
        response: GenerateResponse | None = await self._take("abort", request_id, "aborted")
        return response

    async def pause(self) -> None:
        """Stop decoding between two tokens (returns once the worker has stopped)."""
        await self._call("pause")

    async def resume(self) -> None:
        """Continue decoding after :meth:`pause`."""
        await self._call("resume")

    async def update_weights(
        self,
        source: WeightSource,
        version: int,
        *,
        interrupt_mode: InterruptMode | None = None,
    ) -> None:
        """Install weights between two tokens and set the version (see the module docstring).

        ``source`` is a state dict of the served architecture or a local checkpoint directory. A
        state dict on the worker's own CUDA device is handed over device to device (CUDA IPC);
        any other is copied through the CPU.
        ``version`` may not go below the current version. ``interrupt_mode`` overrides the
        engine's default for this update. A state dict that does not fit raises ``ProtocolError``
        and changes nothing.
        """
        mode = self._interrupt_mode if interrupt_mode is None else interrupt_mode
        if mode not in _MODES:
            raise ProtocolError(f"interrupt_mode={mode!r}: must be one of {_MODES}")
        if not isinstance(version, int) or version < self._version:
            raise ProtocolError(
                f"update_weights(version={version!r}): the engine is at version {self._version}; "
                "versions never go backwards, pass the trainer's new version"
            )
        payload: tuple[bytes, tuple[tuple[Any, ...], ...]] | str | dict[str, Any]
        if isinstance(source, (str, os.PathLike)):
            if not (Path(source) / "config.json").is_file():
                raise ProtocolError(
                    f"update_weights(source={str(source)!r}): not a checkpoint directory (no "
                    "config.json); pass a state_dict or a directory written by save_pretrained"
                )
            payload = str(source)
        elif isinstance(source, Mapping) and _on_device(source, (await self._info()).device):
            # The trainer's GPU is the worker's: tensors travel as CUDA IPC handles and the
            # worker copies device to device. ``source`` stays referenced (the sender's tensors
            # must outlive the copy) until the worker's reply arrives below.
            payload = dict(source)
        elif isinstance(source, Mapping):
            payload = await asyncio.to_thread(_pack_state_dict, source)
        else:
            raise ProtocolError(
                f"update_weights(source={type(source).__name__}): pass a state_dict (a mapping "
                "of parameter names to tensors) or a checkpoint directory"
            )
        stall_s: float = await self._call("update", payload, version, mode)
        with self._state_lock:
            self._version = max(self._version, version)
            self._pauses.append(stall_s * 1000.0)
            self._counts.weight_updates += 1
            self._counts.weight_updates_on_device += isinstance(payload, dict)

    def get_version(self) -> int:
        """The version of the weights installed in the worker (as of the last acknowledged update)."""
        return self._version

    # -- migration ----------------------------------------------------------------------------

    async def export_continuation(self, request_id: str) -> Continuation | None:
        """Take a request out of this engine; its ``agenerate`` returns the partial output with
        ``finish_reason == "abort"``. ``None`` if no such request is in flight here."""
        continuation: Continuation | None = await self._take("export", request_id, "migrated_out")
        return continuation

    async def acontinue(self, continuation: Continuation) -> GenerateResponse:
        """Resume an exported request here; the response holds its old and new tokens."""
        if not isinstance(continuation, Continuation):
            raise ProtocolError(
                f"acontinue expects a Continuation, got {type(continuation).__name__}; get one "
                "from export_continuation(request_id)"
            )
        return await self._submit(continuation, migrated=True)

    # -- inspection ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests submitted here and not yet finished (running or waiting)."""
        return len(self._pending)

    async def progress(self, request_id: str) -> int | None:
        """How many tokens the request has generated so far; ``None`` if it is not in flight."""
        if request_id not in self._pending:
            self._check_open()
            return None
        count: int | None = await self._call("progress", request_id)
        return count

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the counters."""
        with self._state_lock:
            return EngineStatistics(
                version=self._version,
                in_flight=len(self._pending),
                pause_ms=tuple(self._pauses),
                **dataclasses.asdict(self._counts),
            )

    # -- plumbing -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed is not None:
            raise EngineClosedError(f"{self._closed}; create a new LocalEngine to continue")

    async def _info(self) -> _WorkerInfo:
        self._check_open()
        if self._info_now is None:
            self._info_now = await asyncio.wrap_future(self._ready)
        return self._info_now

    async def _submit(self, continuation: Continuation, *, migrated: bool) -> GenerateResponse:
        info = await self._info()
        request = continuation.request
        context = len(request.input_ids) + len(continuation.output_ids)
        if context >= info.max_positions:
            raise ProtocolError(
                f"request {request.request_id!r}: {context} tokens of context, the model takes "
                f"at most {info.max_positions - 1} before generating; shorten the prompt"
            )
        bad = [t for t in (*request.input_ids, *continuation.output_ids) if t >= info.vocab_size]
        if bad:
            raise ProtocolError(
                f"request {request.request_id!r}: token ids {sorted(set(bad))[:5]} are outside "
                f"the vocabulary (size {info.vocab_size}); encode with this model's tokenizer"
            )
        seed = continuation.seed
        if seed is None:
            seed = _derive_seed(self._seed, request.request_id)
        future: concurrent.futures.Future[GenerateResponse] = concurrent.futures.Future()
        with self._state_lock:
            self._check_open()
            if request.request_id in self._pending:
                raise ProtocolError(
                    f"request_id={request.request_id!r} is already in flight on engine "
                    f"{self.name!r}; request ids must be unique among in-flight requests"
                )
            self._pending[request.request_id] = future
            if migrated:
                self._counts.migrated_in += 1
            else:
                self._counts.submitted += 1
        self._outbox.put(("submit", continuation, seed))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller gave up: stop spending decode steps on it.
            if not self._closed and request.request_id in self._pending:
                self._outbox.put(("abort", next(self._tokens), request.request_id))
            raise

    async def _take(self, kind: str, request_id: str, count: str) -> Any:
        """The worker's answer to ``kind`` for an in-flight request, counted under ``count`` when
        there is one; ``None`` when no such request is in flight here."""
        if request_id not in self._pending:
            self._check_open()
            return None
        answer = await self._call(kind, request_id)
        if answer is not None:
            with self._state_lock:
                setattr(self._counts, count, getattr(self._counts, count) + 1)
        return answer

    async def _call(self, kind: str, *args: Any) -> Any:
        token = next(self._tokens)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._state_lock:
            self._check_open()
            self._replies[token] = future
        self._outbox.put((kind, token, *args))
        return await asyncio.wrap_future(future)

    def _send_loop(self) -> None:
        """The sender thread: write queued messages, a burst as one ``("many", [...])``.

        A failed write means the worker is gone; the reader thread then sees the pipe close and
        fails every pending call with the worker's exit code, so nothing is lost silently."""
        outbox = self._outbox
        while True:
            message = outbox.get()
            if message is None:
                return
            batch = [message]
            stop = False
            while True:
                try:
                    more = outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                with self._send_lock:
                    self._conn.send(batch[0] if len(batch) == 1 else ("many", batch))
            except OSError as exc:  # the worker is gone, or close() closed the pipe
                _log.debug("engine %r: sending to the worker failed: %r", self.name, exc)
                return
            except Exception:  # a message that cannot be pickled: fail it alone, send the rest
                for one in batch:
                    try:
                        with self._send_lock:
                            self._conn.send(one)
                    except OSError:
                        return
                    except Exception as exc:
                        self._unsendable(one, exc)
            if stop:
                return

    def _unsendable(self, message: tuple[Any, ...], exc: Exception) -> None:
        """Fail the caller waiting on ``message`` (it never reached the worker)."""
        future: concurrent.futures.Future[Any] | None
        with self._state_lock:
            if message[0] == "submit":
                future = self._pending.pop(message[1].request.request_id, None)
            else:
                future = self._replies.pop(message[1], None)
        _log.warning("engine %r: a %r message could not be sent: %r", self.name, message[0], exc)
        if future is not None:
            _reject(
                future,
                ProtocolError(
                    f"engine {self.name!r}: the {message[0]!r} message could not be sent to the "
                    f"worker ({type(exc).__name__}: {exc}); pass picklable values"
                ),
            )

    def _read_loop(self) -> None:
        reason: str | None = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "done_many":
                for response in message[1]:
                    self._on_done(response)
            elif kind == "done":
                self._on_done(message[2])
            elif kind in ("reply", "error"):
                with self._state_lock:
                    reply = self._replies.pop(message[1], None)
                if reply is None:
                    continue  # e.g. the abort sent for a cancelled agenerate
                if kind == "reply":
                    _resolve(reply, message[2])
                else:
                    _reject(reply, ProtocolError(f"engine {self.name!r}: {message[2]}"))
            elif kind == "ready":
                self._ready.set_result(_WorkerInfo(**message[1]))
            elif kind == "fatal":
                reason = f"engine {self.name!r}: the worker failed:\n{message[1]}"
                _log.error("%s", reason)
                break
        with self._state_lock:
            if self._closed is None:
                self._process.join(1.0)  # reap it, so the message can say how it ended
                code = self._process.exitcode
                self._closed = reason or f"engine {self.name!r}: the worker exited (code {code})"
                self._death = self._closed
        self._fail_all()

    def _on_done(self, response: GenerateResponse) -> None:
        with self._state_lock:
            future = self._pending.pop(response.request_id, None)
            c = self._counts
            c.finished_stop += response.finish_reason == "stop"
            c.finished_length += response.finish_reason == "length"
            c.output_tokens += response.num_output_tokens
            c.resubmits += response.resubmits
        if future is not None:
            _resolve(future, response)

    def _fail_all(self) -> None:
        with self._state_lock:
            reason = self._closed or "closed"
            futures: list[concurrent.futures.Future[Any]] = [
                *self._pending.values(),
                *self._replies.values(),
            ]
            self._pending.clear()
            self._replies.clear()
        if not self._ready.done():
            self._ready.set_exception(EngineClosedError(reason))
        for future in futures:
            _reject(future, EngineClosedError(f"{reason}; create a new LocalEngine to continue"))

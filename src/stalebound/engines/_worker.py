"""The local engine's worker process: continuous batching with a KV cache over a Hugging Face model.

This module runs in the child process started by :class:`stalebound.engines.local.LocalEngine`;
see that module's docstring for the design. Messages are plain tuples over one duplex pipe:

client → worker::

    ("submit", Continuation, seed)            a request (fresh ones are empty continuations)
    ("abort", token, request_id)              reply: GenerateResponse | None
    ("export", token, request_id)             reply: Continuation | None
    ("progress", token, request_id)           reply: number of tokens generated so far | None
    ("pause", token) / ("resume", token)      reply: None
    ("update", token, payload, version, mode) reply: seconds generation was stalled
    ("shutdown",)

worker → client::

    ("ready", info)                           once, after the model loaded
    ("done", request_id, GenerateResponse)    a request finished (stop, length or abort)
    ("reply", token, value) / ("error", token, message)
    ("fatal", message)                        the worker is exiting because of an error
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import signal
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

import torch
from transformers import DynamicCache

from stalebound.engines.cohorts import COHORT_PADDING_SLOTS, next_merge
from stalebound.engines.models import cache_keyword, id_tuple, load_model
from stalebound.engines.protocol import Continuation, FinishReason, GenerateResponse
from stalebound.engines.steplog import StepLog

_log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _layers(out: Any, argument: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer (keys, values) of a forward pass's KV cache."""
    return [(layer.keys, layer.values) for layer in getattr(out, argument).layers]


def uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, index)`` (a SplitMix64 hash).

    Sampling the ``index``-th token of a request from ``uniform(seed, index)`` makes the result
    independent of batching, scheduling and the engine instance — which is what lets a migrated
    or resubmitted request continue its exact random stream.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(tokens, raw model log-probs of those tokens)``.

    Rows with temperature 0 take the argmax. Other rows sample by inverse CDF with the uniform
    ``u`` from the temperature-scaled, top-p-truncated distribution. The returned log-probs are of
    the raw logits (temperature 1, no truncation), see the protocol's contract.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = (temperature > 0).nonzero(as_tuple=True)[0]
    if rows.numel():
        scaled = logits[rows] / temperature[rows, None]
        probs = torch.softmax(scaled, dim=-1)
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p[rows, None]
        cum = (sorted_p * keep).cumsum(dim=-1)
        target = (u[rows] * cum[:, -1].double()).float()
        pos = torch.searchsorted(cum, target[:, None], right=True).clamp_(max=cum.shape[1] - 1)
        tokens[rows] = sorted_i.gather(1, pos).squeeze(1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


@dataclass(eq=False)
class _Sequence:
    """One request inside the worker."""

    cont: Continuation
    seed: int
    order: int
    out_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_ids: frozenset[int]
    resubmits: int = 0
    finish: FinishReason | None = field(default=None)

    @property
    def request_id(self) -> str:
        return self.cont.request.request_id

    @property
    def context(self) -> list[int]:
        return [*self.cont.request.input_ids, *self.out_ids]

    def response(self, finish: FinishReason) -> GenerateResponse:
        return GenerateResponse(
            request_id=self.request_id,
            input_ids=self.cont.request.input_ids,
            output_ids=tuple(self.out_ids),
            output_logprobs=tuple(self.logprobs),
            output_versions=tuple(self.versions),
            finish_reason=finish,
            resubmits=self.resubmits,
        )

    def continuation(self) -> Continuation:
        return Continuation(
            request=self.cont.request,
            output_ids=tuple(self.out_ids),
            output_logprobs=tuple(self.logprobs),
            output_versions=tuple(self.versions),
            seed=self.seed,
            resubmits=self.resubmits,
        )


@dataclass(eq=False)
class _Cohort:
    """Running requests decoded in one forward pass: row i of the KV cache and of the mask
    belongs to ``seqs[i]``. The cache holds every token of a row except its last sampled one
    (the next decode step's input), left-padded with zeros to the longest row; the mask hides
    the padding."""

    seqs: list[_Sequence]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """Rows and width, as :mod:`stalebound.engines.cohorts` takes a cohort."""
        return len(self.seqs), self.width

    def cost(self) -> tuple[int, int, int]:
        """What its next decode pass attends, as :class:`StepLog` takes it: rows, cache width
        (with the token the pass adds) and the tokens its longest answer has generated."""
        return len(self.seqs), self.width + 1, max(len(s.out_ids) for s in self.seqs)


def _merge(a: _Cohort, b: _Cohort) -> _Cohort:
    """One cohort of the rows of ``a`` then ``b``, the shorter cache left-padded."""
    total = max(a.width, b.width)
    kv = [
        (
            torch.cat([_left_pad(k0, total), _left_pad(k1, total)], dim=0),
            torch.cat([_left_pad(v0, total), _left_pad(v1, total)], dim=0),
        )
        for (k0, v0), (k1, v1) in zip(a.kv, b.kv, strict=True)
    ]
    mask = torch.cat([_left_pad_mask(a.mask, total), _left_pad_mask(b.mask, total)])
    return _Cohort([*a.seqs, *b.seqs], kv, mask)


class Worker:
    """The batching state machine around one model (used only inside the worker process)."""

    def __init__(
        self,
        model: Any,
        *,
        version: int,
        max_batch_size: int,
        interrupt_mode: str,
        step_log: StepLog | None = None,
    ) -> None:
        self.model = model
        self.step_log = step_log
        self.installing_s = 0.0
        """Seconds spent installing new weights so far."""
        self._cache_argument = cache_keyword(model)
        self.version = version
        self.max_batch_size = max_batch_size
        self.interrupt_mode = interrupt_mode
        self.paused = False
        self.device = next(model.parameters()).device
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # The generation config's end-of-sequence ids (a list for chat models: end of turn and
        # end of text), and the model config's.
        generation = getattr(model, "generation_config", None)
        self.eos_ids: frozenset[int] = frozenset(
            (
                *id_tuple(model.config.eos_token_id),
                *id_tuple(getattr(generation, "eos_token_id", None)),
            )
        )
        self.waiting: list[tuple[int, int, _Sequence]] = []  # heap: (priority, order, seq)
        self.by_id: dict[str, _Sequence] = {}
        self._order = itertools.count()
        # The running requests, in cohorts of like cache length (see _Cohort): a decode step runs
        # one forward pass per cohort, so a long straggler does not pad every short row to its
        # length. On a CPU an extra pass costs about as much as this many padded cache slots; on
        # an accelerator padding is nearly free and every request joins one cohort.
        self.cohorts: list[_Cohort] = []
        self.padding_budget = COHORT_PADDING_SLOTS if self.device.type == "cpu" else None
        self.finished: list[GenerateResponse] = []

    # -- commands -----------------------------------------------------------------------------

    @property
    def running(self) -> list[_Sequence]:
        """Every running request, cohort by cohort."""
        return [seq for cohort in self.cohorts for seq in cohort.seqs]

    def has_work(self) -> bool:
        return not self.paused and bool(self.cohorts or self.waiting)

    def submit(self, cont: Continuation, seed: int) -> None:
        request = cont.request
        stop = frozenset(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            stop |= self.eos_ids
        seq = _Sequence(
            cont=cont,
            seed=seed,
            order=next(self._order),
            out_ids=list(cont.output_ids),
            logprobs=list(cont.output_logprobs),
            versions=list(cont.output_versions),
            stop_ids=stop,
            resubmits=cont.resubmits,
        )
        self.by_id[seq.request_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: _Sequence) -> None:
        prio = seq.cont.request.priority_version
        heapq.heappush(self.waiting, (self.version if prio is None else prio, seq.order, seq))

    def remove(self, request_id: str) -> _Sequence | None:
        """Take a request out of the engine (abort or export); ``None`` if not here."""
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        cohort = next((c for c in self.cohorts if seq in c.seqs), None)
        if cohort is not None:
            self._keep_rows(cohort, [i for i, s in enumerate(cohort.seqs) if s is not seq])
        else:
            self.waiting = [item for item in self.waiting if item[2] is not seq]
            heapq.heapify(self.waiting)
        return seq

    def progress(self, request_id: str) -> int | None:
        seq = self.by_id.get(request_id)
        return None if seq is None else len(seq.out_ids)

    def update_weights(self, payload: Any, version: int, mode: str) -> None:
        """Install new weights between two decode steps; state is unchanged if this raises."""
        started = time.perf_counter()
        try:
            self._install(payload, version, mode)
        finally:
            self.installing_s += time.perf_counter() - started

    def _install(self, payload: Any, version: int, mode: str) -> None:
        if isinstance(payload, tuple):
            state = _unpack_state_dict(*payload)
        elif isinstance(payload, dict):  # CUDA tensors shared by the trainer on this device
            state = payload
        else:
            state = load_model(payload).state_dict()
        current = self.model.state_dict()
        missing = sorted(set(current) - set(state))
        unexpected = sorted(set(state) - set(current))
        wrong = [
            f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}"
            for k, v in current.items()
            if k in state and tuple(state[k].shape) != tuple(v.shape)
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                "the new weights do not fit the served model: "
                f"missing={missing[:5]} unexpected={unexpected[:5]} wrong shapes={wrong[:5]}; "
                "send the full state_dict() of the same architecture"
            )
        with torch.no_grad():
            # state_dict() tensors share storage with the parameters: copying into them swaps
            # the weights in place, without load_state_dict's per-module bookkeeping.
            for name, tensor in current.items():
                tensor.copy_(state[name])
        self.version = version
        if mode == "resubmit" and self.cohorts:
            # Interruptible generation: drop the KV cache computed by the old weights and requeue
            # prompt + partial output; the next admission recomputes it with the new weights.
            for seq in self.running:
                seq.resubmits += 1
                self._enqueue(seq)
            self.cohorts = []

    # -- decoding -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting requests (prefill), then decode one token for every running request."""
        if self.paused:
            return
        started = time.perf_counter()
        admitted = self._admit()
        admitting = time.perf_counter() - started
        self._consolidate()
        log = self.step_log
        costs = [c.cost() for c in self.cohorts] if log is not None else []
        for cohort in list(self.cohorts):
            self._decode(cohort)
        if log is not None:
            log.admitted(admitted, admitting)
            if costs:
                log.decoded(costs, time.perf_counter() - started - admitting)

    def _admit(self) -> int:
        """Prefill the waiting requests the batch has room for; returns how many."""
        admitted: list[_Sequence] = []
        running = sum(len(c.seqs) for c in self.cohorts)
        while self.waiting and running + len(admitted) < self.max_batch_size:
            admitted.append(heapq.heappop(self.waiting)[2])
        # Prefill requests of equal context length together (no padding inside a prefill).
        by_len: dict[int, list[_Sequence]] = {}
        for seq in admitted:
            by_len.setdefault(len(seq.context), []).append(seq)
        for length, group in sorted(by_len.items()):
            if length >= self.max_positions:
                for seq in group:
                    self._finish(seq, "length")
                continue
            ids = torch.tensor([seq.context for seq in group], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            kv = _layers(out, self._cache_argument)
            done = self._sample_into(group, out.logits[:, -1, :])
            keep = [i for i, seq in enumerate(group) if not done[i]]
            if keep:
                rows = [group[i] for i in keep]
                mask = torch.ones((len(rows), length), dtype=torch.bool, device=self.device)
                self.cohorts.append(_Cohort(rows, _select(kv, keep, len(group)), mask))
        return len(admitted)

    def _consolidate(self) -> None:
        """Merge cohorts of like cache length (after requests joined or left): while two
        neighbours (in cache length) merged would pad fewer slots than one forward pass costs
        (``padding_budget``), or while there are more than ``MAX_COHORTS``, merge the pair that
        pads the fewest."""
        self.cohorts.sort(key=lambda c: c.width)
        while (i := next_merge([c.shape for c in self.cohorts], self.padding_budget)) is not None:
            self.cohorts[i : i + 2] = [_merge(self.cohorts[i], self.cohorts[i + 1])]

    def _decode(self, cohort: _Cohort) -> None:
        seqs = cohort.seqs
        device = self.device
        next_ids = torch.tensor(
            [[seq.out_ids[-1]] for seq in seqs], dtype=torch.long, device=device
        )
        positions = torch.tensor(
            [[len(seq.cont.request.input_ids) + len(seq.out_ids) - 1] for seq in seqs],
            dtype=torch.long,
            device=device,
        )
        mask = torch.cat([cohort.mask, cohort.mask.new_ones((len(seqs), 1))], dim=1)
        out = self.model(
            input_ids=next_ids,
            position_ids=positions,
            attention_mask=None if bool(mask.all()) else mask.long(),
            use_cache=True,
            **{self._cache_argument: DynamicCache(ddp_cache_data=cohort.kv)},
        )
        cohort.kv = _layers(out, self._cache_argument)
        cohort.mask = mask
        done = self._sample_into(seqs, out.logits[:, -1, :])
        if any(done):
            self._keep_rows(cohort, [i for i, d in enumerate(done) if not d])

    def _sample_into(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[bool]:
        """Sample the next token of each sequence; returns which ones finished (and reports them)."""
        device = self.device
        temperature = torch.tensor(
            [s.cont.request.sampling.temperature for s in seqs], device=device
        )
        top_p = torch.tensor([s.cont.request.sampling.top_p for s in seqs], device=device)
        u = torch.tensor(
            [
                0.0 if s.cont.request.sampling.greedy else uniform(s.seed, len(s.out_ids))
                for s in seqs
            ],
            dtype=torch.float64,
            device=device,
        )
        tokens, logprobs = sample(logits, temperature, top_p, u)
        done = []
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.out_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            finish: FinishReason | None = None
            if token in seq.stop_ids:
                finish = "stop"
            elif len(seq.out_ids) >= seq.cont.request.sampling.max_new_tokens or (
                len(seq.cont.request.input_ids) + len(seq.out_ids) >= self.max_positions
            ):
                finish = "length"
            if finish is not None:
                self._finish(seq, finish)
            done.append(finish is not None)
        return done

    def _finish(self, seq: _Sequence, finish: FinishReason) -> None:
        self.by_id.pop(seq.request_id, None)
        self.finished.append(seq.response(finish))

    # -- batch bookkeeping --------------------------------------------------------------------

    def _keep_rows(self, cohort: _Cohort, rows: list[int]) -> None:
        """Keep only these rows of ``cohort`` (dropping it when none is left) and trim the
        columns that are padding in all of them."""
        if not rows:
            self.cohorts.remove(cohort)
            return
        cohort.kv = _select(cohort.kv, rows, len(cohort.seqs))
        cohort.seqs = [cohort.seqs[i] for i in rows]
        mask = cohort.mask[rows] if len(rows) != cohort.mask.shape[0] else cohort.mask
        start = int(mask.any(dim=0).long().argmax())
        if start:
            mask = mask[:, start:]
            cohort.kv = [(k[:, :, start:], v[:, :, start:]) for k, v in cohort.kv]
        cohort.mask = mask

    def take_finished(self) -> list[GenerateResponse]:
        finished, self.finished = self.finished, []
        return finished


def _unpack_state_dict(
    blob: bytes, index: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
) -> dict[str, torch.Tensor]:
    buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else None
    state = {}
    for name, dtype, shape, offset, nbytes in index:
        if buffer is None:
            raise ValueError(f"weights blob is empty but the index names {name!r}")
        raw = buffer[offset : offset + nbytes]
        state[name] = raw.view(getattr(torch, dtype)).view(shape)
    return state


def _select(
    kv: list[tuple[torch.Tensor, torch.Tensor]], rows: list[int], batch: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(rows) == batch:
        return kv
    index = torch.tensor(rows, dtype=torch.long, device=kv[0][0].device)
    return [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]


def _left_pad(t: torch.Tensor, total: int) -> torch.Tensor:
    # Zeros, not garbage: padded keys are masked out, and finite values keep the softmax finite.
    missing = total - t.shape[2]
    if not missing:
        return t
    pad = t.new_zeros((t.shape[0], t.shape[1], missing, t.shape[3]))
    return torch.cat([pad, t], dim=2)


def _left_pad_mask(mask: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - mask.shape[1]
    if not missing:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


TERMINAL_SIGNALS: frozenset[signal.Signals] = frozenset({signal.SIGINT, signal.SIGTERM})
"""Blocked while the worker starts (see :func:`leave_the_terminal`)."""


@contextlib.contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread while a worker process is started: the worker inherits
    the mask and unblocks them once it ignores the terminal's (``leave_the_terminal``); here
    one that arrives meanwhile is handled when the block ends."""
    # Starting multiprocessing's resource tracker unblocks these two signals in the calling
    # thread; started first, it leaves the mask alone while the worker is spawned.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_the_terminal() -> None:
    """Keep a terminal's Ctrl-C (and ``kill -- -PGID``) away from the worker.

    A terminal sends SIGINT to its whole foreground process group. Were the worker to die of it,
    the trainer could not finish its step and checkpoint, which is what Ctrl-C asks of it. So the
    worker ignores SIGINT and leaves the group for a session of its own. It still ends with its
    trainer: the pipe reads end-of-file when the trainer dies, however it dies, and SIGTERM or
    SIGKILL sent to the worker itself end it. The client starts it with SIGINT and SIGTERM blocked,
    so one that arrives before this runs stays pending; setting it to ignored drops it here.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drops one sent to the group meanwhile
    with contextlib.suppress(OSError):  # already a session leader (started some other way)
        os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)


def worker_main(
    conn: Connection,
    model_path: str,
    version: int,
    max_batch_size: int,
    interrupt_mode: str,
    num_threads: int,
    device: str = "cpu",
    dtype: str = "float32",
    step_log: str | None = None,
) -> None:
    """Entry point of the worker process: load the model (on ``device``, in ``dtype``), then serve
    the pipe until shutdown; with ``step_log``, append what the steps cost to that file
    (:mod:`stalebound.engines.steplog`)."""
    leave_the_terminal()
    torch.set_num_threads(num_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model = load_model(model_path, device=device, dtype=dtype)
        worker = Worker(
            model,
            version=version,
            max_batch_size=max_batch_size,
            interrupt_mode=interrupt_mode,
            step_log=None if step_log is None else StepLog(step_log),
        )
        conn.send(
            (
                "ready",
                {
                    "vocab_size": int(model.config.vocab_size),
                    "max_positions": worker.max_positions,
                    "eos_ids": tuple(sorted(worker.eos_ids)),
                    "pid": os.getpid(),
                    "device": str(worker.device),
                },
            )
        )
        try:
            _serve(conn, worker)
        finally:
            if worker.step_log is not None:
                worker.step_log.close()
        conn.close()
        # A clean shutdown: nothing to flush, and skipping interpreter teardown of torch and
        # transformers makes close() return in milliseconds instead of seconds.
        os._exit(0)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the client went away: nothing left to report to
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("fatal", traceback.format_exc()))


def _serve(conn: Connection, worker: Worker) -> None:
    while True:
        # Block when there is nothing to decode (no sleep-polling); otherwise take what has
        # arrived since the last step, so requests join and leave between tokens.
        if not worker.has_work():
            conn.poll(None)
        if conn.poll():
            started = time.perf_counter()  # after any idle wait: only the transfer counts
            installing = worker.installing_s
            message = conn.recv()
            going_on = _handle(conn, worker, message, started)
            if worker.step_log is not None:  # the pipe's share: all but installing weights
                pipe = time.perf_counter() - started - (worker.installing_s - installing)
                worker.step_log.piped(pipe)
            if not going_on:
                return
            continue
        worker.step()
        finished = worker.take_finished()
        if finished:  # one message for all that finished in this step
            started = time.perf_counter()
            conn.send(("done_many", finished))
            if worker.step_log is not None:
                worker.step_log.piped(time.perf_counter() - started)


def _handle(conn: Connection, worker: Worker, message: tuple[Any, ...], started: float) -> bool:
    kind = message[0]
    if kind == "many":  # what the client's sender queued meanwhile, in order
        return all(_handle(conn, worker, m, started) for m in message[1])
    if kind == "submit":
        worker.submit(message[1], message[2])
        return True
    if kind == "shutdown":
        return False
    token = message[1]
    try:
        reply: Any = None
        if kind == "abort" or kind == "export":
            seq = worker.remove(message[2])
            if seq is not None:
                response = seq.response("abort")
                conn.send(("done", response.request_id, response))
                reply = response if kind == "abort" else seq.continuation()
        elif kind == "progress":
            reply = worker.progress(message[2])
        elif kind == "pause":
            worker.paused = True
        elif kind == "resume":
            worker.paused = False
        elif kind == "update":
            _, _, payload, version, mode = message
            worker.update_weights(payload, version, mode)
            reply = time.perf_counter() - started
        else:
            raise ValueError(f"unknown worker command {kind!r}")
    except Exception as exc:
        conn.send(("error", token, f"{type(exc).__name__}: {exc}"))
    else:
        conn.send(("reply", token, reply))
    return True

"""Calling a user's reward function: the interface checked once, every failure turned into data.

A reward is ``reward(prompt, completion, **columns)`` — a plain function or a coroutine function —
returning a number, or a mapping with ``reward`` and any other numeric metrics (logged as
``reward/<name>``). Its failures never stop a run: an exception, a call that outlives
``task.reward_timeout_s``, ``None``, NaN or anything not a number is a :class:`RewardOutcome`
with ``failure`` set to one of :data:`FAILURES`, which the caller counts and marks on the
trajectory. CPU-heavy verifiers can run in ``task.reward_workers`` processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import multiprocessing
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.plugins import load_object

__all__ = [
    "BUILTIN_REWARDS",
    "FAILURES",
    "RewardFunction",
    "RewardOutcome",
    "load_reward",
    "outcome_of",
]

BUILTIN_REWARDS: Mapping[str, str] = {
    "exact": "stalebound.rewards.builtin:exact_match",
    "numeric": "stalebound.rewards.builtin:numeric_match",
    "regex": "stalebound.rewards.builtin:regex_match",
}
"""Short names for the built-in verifiers (``task.reward=numeric``)."""

FAILURES = ("raised", "timeout", "none", "nan", "not_a_number")
"""Why a reward call gave no usable reward."""


@dataclass(frozen=True)
class RewardOutcome:
    """One reward call's result: ``reward`` and extra ``metrics`` when it succeeded, else
    ``failure`` (one of :data:`FAILURES`) and a one-line ``detail``."""

    reward: float | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    failure: str | None = None
    detail: str = ""


def _failed(cause: str, detail: str) -> RewardOutcome:
    return RewardOutcome(None, {}, cause, detail)


def _number(value: Any, what: str) -> float | RewardOutcome:
    if value is None:
        return _failed("none", f"{what} is None")
    if isinstance(value, bool):
        return float(value)
    try:
        x = float(value)
    except (TypeError, ValueError):
        return _failed("not_a_number", f"{what} is {type(value).__name__} {str(value)[:40]!r}")
    if not math.isfinite(x):
        return _failed("nan", f"{what} is {x}")
    return x


def outcome_of(value: Any) -> RewardOutcome:
    """What a reward function's return value means (see the module docstring)."""
    if isinstance(value, Mapping):
        if "reward" not in value:
            return _failed(
                "not_a_number", f"the mapping has no 'reward' key (keys: {sorted(value)[:8]})"
            )
        reward = _number(value["reward"], "reward")
        if isinstance(reward, RewardOutcome):
            return reward
        metrics = {}
        for k, v in value.items():
            if k == "reward":
                continue
            x = _number(v, f"metric {k!r}")
            if isinstance(x, RewardOutcome):
                return x
            metrics[str(k)] = x
        return RewardOutcome(reward, metrics)
    reward = _number(value, "the reward")
    return reward if isinstance(reward, RewardOutcome) else RewardOutcome(reward)


def _call_in_worker(spec: str, prompt: Any, completion: str, columns: dict[str, Any]) -> Any:
    """Run in a reward worker process: load the function by name (cached) and call it."""
    fn = _WORKER_CACHE.get(spec)
    if fn is None:
        fn = _WORKER_CACHE[spec] = load_object(spec, "task.reward")
    return fn(prompt, completion, **columns)


_WORKER_CACHE: dict[str, Callable[..., Any]] = {}


class RewardFunction:
    """A reward function named by ``spec`` (a built-in name, ``module:function`` or
    ``file.py:function``), checked once and called through :meth:`score`.

    ``columns`` (the dataset's column names, when known) lets the check name a parameter the data
    does not have; only the columns the function accepts are passed (all of them when it takes
    ``**columns``)."""

    def __init__(
        self,
        spec: str,
        *,
        timeout_s: float | None = None,
        workers: int = 0,
        columns: Sequence[str] | None = None,
        setting: str = "task.reward",
    ) -> None:
        self.spec = BUILTIN_REWARDS.get(spec, spec)
        self.setting = setting
        fn = load_object(self.spec, setting)
        if not callable(fn):
            raise ConfigError(
                f"{setting}={spec!r}: names a {type(fn).__name__}, not a function; name a "
                "function reward(prompt, completion, **columns)"
            )
        self.fn: Callable[..., Any] = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
        )
        self._accepts_all, self._params = self._check_signature(spec, columns)
        self.timeout_s = timeout_s
        if workers and self.is_async:
            raise ConfigError(
                f"task.reward_workers={workers}: {spec!r} is a coroutine function, which runs on "
                "the event loop; set task.reward_workers=0 (processes are for CPU-heavy sync "
                "functions)"
            )
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _check_signature(
        self, spec: str, columns: Sequence[str] | None
    ) -> tuple[bool, frozenset[str]]:
        fix = "define it as def reward(prompt, completion, **columns)"
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return True, frozenset()  # a builtin or C function: trust it
        params = list(sig.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
        if len(positional) < 2 and not var_positional:
            raise ConfigError(
                f"{self.setting}={spec!r}: {self.fn.__name__}{sig} takes "
                f"{len(positional)} positional argument(s), but a reward is called with the "
                f"prompt and the completion; {fix}"
            )
        accepts_all = any(p.kind is p.VAR_KEYWORD for p in params)
        named = frozenset(p.name for p in params[2:] if p.kind is not p.VAR_KEYWORD)
        if columns is not None:
            required = [
                p.name
                for p in params[2:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
            missing = [n for n in required if n not in columns]
            if missing:
                raise ConfigError(
                    f"{self.setting}={spec!r}: {self.fn.__name__} needs {missing}, which the data "
                    f"does not have (its columns: {sorted(columns)}); give those parameters "
                    "defaults, rename them after columns, or take **columns"
                )
        return accepts_all, named

    def _columns(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        if self._accepts_all:
            return dict(columns)
        return {k: v for k, v in columns.items() if k in self._params}

    async def score(
        self, prompt: Any, completion: str, columns: Mapping[str, Any]
    ) -> RewardOutcome:
        """Call the reward; never raises for the reward's own failures."""
        kwargs = self._columns(columns)
        try:
            if self.is_async:
                value = await asyncio.wait_for(
                    self.fn(prompt, completion, **kwargs), self.timeout_s
                )
            elif self.workers:
                value = await asyncio.wait_for(
                    self._in_pool(prompt, completion, kwargs), self.timeout_s
                )
            else:
                value = await asyncio.wait_for(
                    asyncio.to_thread(self.fn, prompt, completion, **kwargs), self.timeout_s
                )
        except asyncio.TimeoutError:
            if self.workers:
                self._restart_pool()  # a hung worker holds its process: replace the pool
            return _failed("timeout", f"no result within task.reward_timeout_s={self.timeout_s}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            line = traceback.format_exception_only(type(e), e)[-1].strip()
            return _failed("raised", line[:200])
        return outcome_of(value)

    async def _in_pool(self, prompt: Any, completion: str, kwargs: dict[str, Any]) -> Any:
        for attempt in (1, 2):
            future = self._executor().submit(_call_in_worker, self.spec, prompt, completion, kwargs)
            try:
                return await asyncio.wrap_future(future)
            except concurrent.futures.process.BrokenProcessPool:
                # the pool was replaced under this call (another call hung): run it once more
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn")
            )
        return self._pool

    def _restart_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()  # a call that hangs cannot be cancelled any other way
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker processes (if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def load_reward(spec: str, **kwargs: Any) -> RewardFunction:
    """:class:`RewardFunction` ``(spec, **kwargs)``."""
    return RewardFunction(spec, **kwargs)

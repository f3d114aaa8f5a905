"""Cutting a workflow's own waits short when its episode is truncated.

A truncation (the ``deadline`` policy at a group's deadline, the proactive filter) aborts the
member's engine requests, and the engine hands back the partial output. A wait the workflow does
itself — a tool call, an environment step, a sandbox — is out of the engine's reach: without help
the episode only notices the truncation at its next request, and the trainer waits for it.

A workflow that awaits such a wait through :func:`interruptible` lets the executor end it::

    from stalebound.runtime import EpisodeTruncated, interruptible

    try:
        observation = await interruptible(call_tool(expr))
    except EpisodeTruncated:
        break  # end the episode with what it has; mark the trajectory truncated

Outside a running episode of the executor (a unit test, a plain ``asyncio.run``),
:func:`interruptible` simply awaits. Cancelling the wait cancels the awaitable's task, so the tool
call itself must tolerate :class:`asyncio.CancelledError` (an HTTP request does).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TypeVar

from stalebound.core import MemberId

__all__ = ["CutSignal", "EpisodeTruncated", "interruptible", "running_member"]

T = TypeVar("T")


class EpisodeTruncated(Exception):
    """Raised by :func:`interruptible` in a workflow whose episode was truncated: end the episode
    with the output it has (mark the trajectory truncated)."""


class CutSignal:
    """What a running episode is told when it is truncated (the executor's member tasks are
    these). :meth:`cut` is called once by the executor; waits in :func:`interruptible` end."""

    __slots__ = ("_cut_waiter", "mid", "truncated")

    def __init__(self, mid: MemberId | None = None) -> None:
        self.mid = mid  # the group's id and the member's launch index
        self.truncated = False  # its requests are aborted as they come; its output is kept
        self._cut_waiter: asyncio.Future[None] | None = None  # made by the first wait

    def cut(self) -> None:
        """Mark the episode truncated and end the wait under way, if any."""
        self.truncated = True
        waiter = self._cut_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def enter(self) -> None:
        """Make this the running episode of the current task (and of the tasks it starts): what
        the executor does at the start of each member's task."""
        _EPISODE.set(self)

    def waiter(self) -> asyncio.Future[None]:
        """A future of the running loop that is done once the episode is cut."""
        waiter = self._cut_waiter
        if waiter is None:
            waiter = self._cut_waiter = asyncio.get_running_loop().create_future()
            if self.truncated:
                waiter.set_result(None)
        return waiter


_EPISODE: ContextVar[CutSignal | None] = ContextVar("stalebound_episode", default=None)


def running_member() -> MemberId | None:
    """The group id and launch index of the episode the current task runs for the executor;
    ``None`` outside its episodes. What a trace records as ``group_id`` and ``member``."""
    signal = _EPISODE.get()
    return None if signal is None else signal.mid


async def interruptible(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, unless the running episode is (or gets) truncated first: then the
    awaitable is cancelled and :class:`EpisodeTruncated` is raised. Outside the executor's
    episodes it simply awaits."""
    if not inspect.isawaitable(awaitable):
        raise TypeError(
            f"interruptible({awaitable!r}): needs an awaitable (a coroutine, task or future); "
            "call the tool and pass what it returns, e.g. interruptible(call_tool(x))"
        )
    signal = _EPISODE.get()
    if signal is None:
        return await awaitable
    if signal.truncated:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never awaited: close it, or Python warns
        raise EpisodeTruncated("the episode was truncated before this wait")
    task = asyncio.ensure_future(awaitable)
    cut = False
    try:
        await asyncio.wait((task, signal.waiter()), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # cut, or the episode itself was cancelled
            task.cancel()
            cut = True
    if cut:
        raise EpisodeTruncated("the episode was truncated during this wait")
    return task.result()  # it finished first (or at the same moment): keep what it gave

"""One asyncio event loop in a background thread, and the hops onto it from other threads.

:class:`LoopThread` is the thread plumbing of the :class:`~stalebound.runtime.WorkflowExecutor`:
everything that touches the executor's state runs on the loop thread; callers on other threads
hop there (:meth:`~LoopThread._call`, :meth:`~LoopThread._answer`) and wait for the answer. A
dispatcher task sleeps on an :class:`asyncio.Event` that :meth:`~LoopThread._kick_threadsafe`
sets; a burst of kicks from other threads costs one hop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from stalebound.core import ProtocolError

__all__ = ["LoopThread", "NamedTimers", "settle"]

_T = TypeVar("_T")
_Self = TypeVar("_Self", bound="LoopThread")


class LoopThread:
    """A loop thread with a dispatcher task; subclasses supply :meth:`_dispatch_forever`.

    ``loop_factory`` builds the event loop (default :func:`asyncio.new_event_loop`). Its
    ``time()`` is the clock of everything run on it — every event's time and every timer — so a
    test can pass a loop with a virtual clock and replay a run step by step, without sleeping.
    """

    def __init__(self, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> None:
        self._loop_factory = loop_factory or asyncio.new_event_loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop_tid: int | None = None
        self._closed = False
        self._wake: asyncio.Event | None = None
        self._kick_pending = False
        self._waiters: list[asyncio.Future[None]] = []  # of callers waiting for results

    # ------------------------------------------------------------------ for subclasses

    async def _dispatch_forever(self) -> None:
        raise NotImplementedError

    def _loop_started(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the loop thread before anything runs there."""

    def _require_running(self) -> Any:
        if self._closed:
            raise ProtocolError("the executor was destroyed; build a new WorkflowExecutor")
        if self._loop is None:
            raise ProtocolError("the executor is not initialized; call initialize() first")

    # ------------------------------------------------------------------ lifecycle

    def destroy(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _start_thread(self, name: str) -> None:
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run_loop, args=(started,), name=name, daemon=True
        )
        self._thread.start()
        started.wait()

    def _stop_thread(self, shutdown: Coroutine[Any, Any, None]) -> None:
        """Run ``shutdown`` on the loop, stop it and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            shutdown.close()
            return
        if threading.get_ident() == self._loop_tid:
            shutdown.close()
            raise ProtocolError("destroy(): call it from outside the executor's own workflows")
        asyncio.run_coroutine_threadsafe(shutdown, loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    def _run_loop(self, started: threading.Event) -> None:
        loop = self._loop_factory()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._loop_tid = threading.get_ident()
        self._wake = asyncio.Event()
        self._loop_started(loop)
        dispatcher = loop.create_task(self._dispatch_forever())
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            # Cancel what is left (the dispatcher, waits of other threads) and run the loop until
            # their callbacks have run, so that no caller is left blocked on a dead loop.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, dispatcher, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    # ------------------------------------------------------------------ hops onto the loop

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the loop thread and return its result."""
        self._require_running()
        if threading.get_ident() == self._loop_tid:
            return fn(*args)
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(run)
        return future.result()

    def _answer(
        self,
        op: str,
        now: Callable[[], _T | None],
        later: Callable[[], Coroutine[Any, Any, _T]],
    ) -> _T:
        """One hop onto the loop: ``now()``'s answer when it has one (not ``None``), else wait
        there for ``later()``'s."""
        loop = self._loop
        assert loop is not None
        if threading.get_ident() == self._loop_tid:
            raise ProtocolError(
                f"{op}: would block the executor's own loop; call it from another thread"
            )
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def done(task: asyncio.Task[_T]) -> None:
            if task.cancelled():
                future.set_exception(ProtocolError(f"{op}: the executor was destroyed"))
            elif (exc := task.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(task.result())

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                answer = now()
                if answer is not None:
                    future.set_result(answer)
                    return
                loop.create_task(later()).add_done_callback(done)
            except BaseException as e:
                future.set_exception(e)

        loop.call_soon_threadsafe(run)
        return future.result()

    def run_coroutine(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the executor's event loop from another thread and wait for its result,
        e.g. ``engine.update_weights(...)`` for the engine the workflows share."""
        self._require_running()
        if threading.get_ident() == self._loop_tid:
            raise ProtocolError("run_coroutine(): call it from outside the executor's loop thread")
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ waking the dispatcher

    def _kick_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or self._closed:
            return
        if threading.get_ident() == self._loop_tid:
            self._kick()
        elif not self._kick_pending:
            # at most one pending hop: a burst of submissions costs one wake-up
            self._kick_pending = True
            loop.call_soon_threadsafe(self._kicked)

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread: at once when called there, else by a hop that
        does not wait; nothing before the loop runs or once it is closed."""
        loop = self._loop
        if loop is None or self._closed:
            return
        if threading.get_ident() == self._loop_tid:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ waking waiting callers

    def _park(self) -> asyncio.Future[None]:
        """A future the next :meth:`_notify` resolves (call on the loop thread)."""
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(waiter)
        return waiter

    def _notify(self) -> None:
        """Wake every caller parked in :meth:`_park`."""
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

    def _kicked(self) -> None:
        self._kick_pending = False
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()


class NamedTimers:
    """Loop timers by name (at most one each); firing calls ``fire(name)`` on the loop."""

    def __init__(self, fire: Callable[[str], None]) -> None:
        self._fire = fire
        self._handles: dict[str, asyncio.TimerHandle] = {}

    def arm(self, name: str, at: float) -> None:
        """Fire ``name`` at loop time ``at``, replacing an earlier arming."""
        self.cancel(name)
        loop = asyncio.get_running_loop()
        self._handles[name] = loop.call_at(at, self._fired, name)

    def cancel(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for name in list(self._handles):
            self.cancel(name)

    def get(self, name: str) -> asyncio.TimerHandle | None:
        return self._handles.get(name)

    def _fired(self, name: str) -> None:
        self._handles.pop(name, None)
        self._fire(name)


def settle(f: asyncio.Future[None]) -> None:
    """Wake whoever awaits ``f`` (once)."""
    if not f.done():
        f.set_result(None)

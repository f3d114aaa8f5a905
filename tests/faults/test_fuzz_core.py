"""Hostile calls to the core's public API: every refusal is typed, named, and changes nothing.

Each property first drives an object into a random valid state (a random sequence of legal
operations), then throws one hostile call at it: unknown, unhashable or already-used ids, versions
that are negative, from the future, huge, ``bool``, ``float``, ``None`` or text, non-iterable
segment versions, garbage causes, and restores from mutated or garbage snapshots. The call either
succeeds, or raises a :class:`~stalebound.core.errors.StaleboundError` subclass whose message
names the bad value, and then the object's whole state (``snapshot()``, or ``statistics()`` and
its public answers) is exactly what it was, and ``check_invariants()`` still holds.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalebound.core import (
    BufferPolicy,
    CapacityCounter,
    CapacityPolicy,
    ConfigError,
    GroupTracker,
    MemberId,
    ProtocolError,
    StaleboundError,
    StalenessBuffer,
    filters,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- hostile values ------------------------------------------------------------------------------------

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.sampled_from([-1, 2**63, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["", "\x00", "é" * 50, "x" * 500]),
    st.lists(st.integers(), max_size=3),  # unhashable
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),  # unhashable
    st.sets(st.integers(), max_size=2),  # unhashable
    st.tuples(st.integers(), st.text(max_size=3)),
    st.just(object()),
)
VERSIONS = st.one_of(
    HOSTILE, st.integers(-5, 30), st.sampled_from([math.nan, math.inf, -math.inf, 1.5, True])
)
IDS = st.one_of(st.sampled_from([f"g{i}" for i in range(12)]), HOSTILE)


def shows(value: Any, message: str) -> bool:
    """Whether ``message`` names ``value`` (its repr, or the start of a long one)."""
    try:
        text = repr(value)
    except ValueError:
        return True
    return text[:60] in message or str(value)[:60] in message


def assert_refused_cleanly(
    call: Callable[[], Any],
    state: Callable[[], Any],
    bad: tuple[Any, ...],
    check: Callable[[], Any],
) -> Any:
    """Run ``call``; if it raises, the error is typed and names one of ``bad``, and nothing moved."""
    before = state()
    try:
        result = call()
    except StaleboundError as exc:
        assert isinstance(exc, (ConfigError, ProtocolError)), f"{type(exc).__name__}: {exc}"
        # (A call without arguments, like consume(), has no bad value to name.)
        assert not bad or any(shows(b, str(exc)) for b in bad), f"{exc} names none of {bad!r}"
        assert state() == before, f"a refused call changed the state ({exc})"
        check()
        return None
    check()
    return result


# -- StalenessBuffer in a random valid state ------------------------------------------------------


@st.composite
def buffers(draw: st.DrawFn) -> StalenessBuffer:
    batch = draw(st.integers(1, 3))
    buf = StalenessBuffer(
        batch,
        draw(st.integers(0, 3)),
        buffer_size=draw(st.integers(batch, batch + 2)),
        start_version=draw(st.integers(0, 5)),
    )
    n = 0
    for op in draw(
        st.lists(st.sampled_from(["reserve", "occupy", "abort", "consume"]), max_size=30)
    ):
        in_flight = list(buf._groups)  # (reads only, to choose legal operations)
        reserved = [g for g in in_flight if not buf._groups[g].occupied]
        if op == "reserve":
            version = draw(st.integers(max(0, buf.version - buf.staleness), buf.version))
            buf.try_reserve(f"g{n}", version)
            n += 1
        elif op == "occupy" and reserved:
            buf.occupy(draw(st.sampled_from(reserved)), payload={"n": n})
        elif op == "abort" and in_flight:
            buf.abort(
                draw(st.sampled_from(in_flight)), draw(st.sampled_from(["aborted", "filtered"]))
            )
        elif op == "consume" and buf.ready():
            buf.consume()
    buf.check_invariants()
    return buf


def buffer_state(buf: StalenessBuffer) -> Any:
    return (buf.snapshot(), buf.statistics())


@SETTINGS
@given(buffers(), st.data())
def test_buffer_refuses_hostile_calls_without_changing_state(
    buf: StalenessBuffer, data: st.DataObject
) -> None:
    gid = data.draw(IDS, label="group_id")
    version = data.draw(VERSIONS, label="version")
    other = data.draw(HOSTILE, label="other")
    calls: dict[str, tuple[Callable[[], Any], tuple[Any, ...]]] = {
        "try_reserve": (lambda: buf.try_reserve(gid, version), (gid, version)),
        "try_reserve_default": (lambda: buf.try_reserve(gid), (gid,)),
        "occupy": (lambda: buf.occupy(gid, other), (gid,)),
        "occupy_segments": (
            lambda: buf.occupy(gid, segment_versions=other),
            (gid, other, *(other if isinstance(other, (list, tuple, set)) else ())),
        ),
        "occupy_bad_segment": (
            lambda: buf.occupy(gid, segment_versions=[version]),
            (gid, version),
        ),
        "abort": (lambda: buf.abort(gid, other), (gid, other)),
        "abort_default": (lambda: buf.abort(gid), (gid,)),
        "consume": (buf.consume, ()),
        "capacity": (lambda: buf.capacity(version), (version,)),
        "state": (lambda: buf.state(version), (version,)),
        "entries": (lambda: buf.entries(version), (version,)),
        "reserved_groups": (lambda: buf.reserved_groups(version), (version,)),
        "occupied_groups": (lambda: buf.occupied_groups(version), (version,)),
        "pull_forward": (lambda: buf.pull_forward(version), (version,)),
        "lookup": (lambda: buf.lookup(gid), (gid,)),
        "contains": (lambda: gid in buf, (gid,)),
    }
    name = data.draw(st.sampled_from(sorted(calls)), label="call")
    call, bad = calls[name]
    mutating = name in {"try_reserve", "try_reserve_default", "occupy", "occupy_segments"}
    mutating = mutating or name in {"occupy_bad_segment", "abort", "abort_default", "consume"}
    if mutating or name == "pull_forward":
        assert_refused_cleanly(call, lambda: buffer_state(buf), bad, buf.check_invariants)
    else:  # queries never change anything, refused or not
        before = buffer_state(buf)
        assert_refused_cleanly(call, lambda: buffer_state(buf), bad, buf.check_invariants)
        assert buffer_state(buf) == before


def _mutate(snapshot: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """One field of the snapshot (top level, a counter, or a group's) replaced by garbage."""
    bad = copy.deepcopy(snapshot)
    where = data.draw(st.sampled_from(["top", "counter", "group", "drop", "whole"]))
    value = data.draw(VERSIONS)
    if where == "top":
        bad[data.draw(st.sampled_from(sorted(bad)))] = value
    elif where == "counter":
        bad["counters"][data.draw(st.sampled_from(sorted(bad["counters"])))] = value
    elif where == "group" and bad["groups"]:
        item = data.draw(st.sampled_from(bad["groups"]))
        item[data.draw(st.sampled_from([*sorted(item), "seq"]))] = value
    elif where == "drop":
        bad.pop(data.draw(st.sampled_from(sorted(bad))))
    elif where == "whole":
        return data.draw(HOSTILE)  # type: ignore[no-any-return]
    return bad


@SETTINGS
@given(buffers(), st.data())
def test_restore_refuses_damaged_snapshots(buf: StalenessBuffer, data: st.DataObject) -> None:
    good = buf.snapshot()
    restored = StalenessBuffer.restore(good)
    assert restored.snapshot() == good
    bad = _mutate(good, data)
    frozen = _containers_copied(bad)
    try:
        again = StalenessBuffer.restore(bad)
    except StaleboundError as exc:
        assert isinstance(exc, (ConfigError, ProtocolError)), f"{type(exc).__name__}: {exc}"
        assert "snapshot" in str(exc) or "=" in str(exc), f"unclear: {exc}"
    else:  # a change restore accepts must still make a consistent buffer
        again.check_invariants()
        assert StalenessBuffer.restore(again.snapshot()).snapshot() == again.snapshot()
    assert _same(bad, frozen), "restore() changed the snapshot it was given"
    assert buf.snapshot() == good


def _containers_copied(value: Any) -> Any:
    """``value`` with its dicts and lists copied and its leaves shared (compared by identity)."""
    if isinstance(value, dict):
        return {k: _containers_copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_containers_copied(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or repr(a) == repr(b)  # NaN inside: compare the text
    except ValueError:
        return True


# -- the policies ---------------------------------------------------------------------------------


@st.composite
def policies(draw: st.DrawFn) -> BufferPolicy | CapacityPolicy:
    batch, eta = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    policy: BufferPolicy | CapacityPolicy
    if draw(st.booleans()):
        policy = BufferPolicy(
            StalenessBuffer(batch, eta, buffer_size=batch + draw(st.integers(0, 2))),
            draw(st.none() | st.integers(1, 6)),
        )
    else:
        counter = CapacityCounter(draw(st.integers(1, 6)), batch, eta)
        policy = CapacityPolicy(counter, drop_stale=draw(st.booleans()))
    for n, op in enumerate(
        draw(st.lists(st.sampled_from(["admit", "complete", "abort", "consume"]), max_size=25))
    ):
        running = [g for g in (f"g{i}" for i in range(n)) if policy.is_running(g)]
        if op == "admit":
            policy.try_admit(f"g{n}")
        elif op == "complete" and running:
            policy.complete(draw(st.sampled_from(running)), payload=n)
        elif op == "abort" and running:
            policy.abort(draw(st.sampled_from(running)))
        elif op == "consume" and policy.ready():
            policy.consume()
    return policy


def policy_state(policy: BufferPolicy | CapacityPolicy) -> Any:
    inner = (
        policy.buffer.snapshot()
        if isinstance(policy, BufferPolicy)
        else (
            vars(policy.counter.stat).copy(),
            list(policy._done),  # (read only: the FIFO of results is the policy's state)
            dict(policy._running),
        )
    )
    return policy.statistics(), policy.capacity(), policy.ready(), inner


@SETTINGS
@given(policies(), st.data())
def test_policies_refuse_hostile_calls_without_changing_state(
    policy: BufferPolicy | CapacityPolicy, data: st.DataObject
) -> None:
    gid = data.draw(IDS, label="group_id")
    version = data.draw(VERSIONS, label="version")
    other = data.draw(HOSTILE, label="other")
    calls: dict[str, tuple[Callable[[], Any], tuple[Any, ...]]] = {
        "try_admit": (lambda: policy.try_admit(gid, version), (gid, version)),
        "complete": (lambda: policy.complete(gid, other), (gid,)),
        "complete_segments": (
            lambda: policy.complete(gid, segment_versions=other),
            (gid, other, *(other if isinstance(other, (list, tuple, set)) else ())),
        ),
        "complete_bad_segment": (
            lambda: policy.complete(gid, segment_versions=[version]),
            (gid, version),
        ),
        "abort": (lambda: policy.abort(gid, other), (gid, other)),
        "consume": (policy.consume, ()),
        "capacity": (lambda: policy.capacity(version), (version,)),
        "is_running": (lambda: policy.is_running(gid), (gid,)),
    }
    name = data.draw(st.sampled_from(sorted(calls)), label="call")
    call, bad = calls[name]
    check = policy.buffer.check_invariants if isinstance(policy, BufferPolicy) else lambda: None
    assert_refused_cleanly(call, lambda: policy_state(policy), bad, check)


def _empty_like(policy: BufferPolicy | CapacityPolicy) -> BufferPolicy | CapacityPolicy:
    if isinstance(policy, BufferPolicy):
        b = policy.buffer
        return BufferPolicy(
            StalenessBuffer(b.batch_size, b.staleness, buffer_size=b.buffer_size),
            policy.max_concurrent,
        )
    c = policy.counter
    counter = CapacityCounter(c.max_concurrent_rollouts, c.consumer_batch_size, c.staleness)
    return CapacityPolicy(counter, drop_stale=policy.drop_stale)


@SETTINGS
@given(policies(), st.data())
def test_policy_load_snapshot_takes_a_good_one_and_refuses_damage_unchanged(
    policy: BufferPolicy | CapacityPolicy, data: st.DataObject
) -> None:
    good = policy.snapshot()
    fresh = _empty_like(policy)
    fresh.load_snapshot(copy.deepcopy(good))
    assert fresh.snapshot() == good and fresh.statistics() == policy.statistics()
    target = _empty_like(policy)
    before = policy_state(target)
    bad = copy.deepcopy(good)
    where = data.draw(st.sampled_from(["top", "drop", "inner", "whole"]))
    value = data.draw(VERSIONS)
    if where == "top":
        bad[data.draw(st.sampled_from(sorted(bad)))] = value
    elif where == "drop":
        bad.pop(data.draw(st.sampled_from(sorted(bad))))
    elif where == "inner":
        key = "buffer" if "buffer" in bad else "stat"
        inner = bad[key]
        if isinstance(inner, dict) and inner:
            inner[data.draw(st.sampled_from(sorted(inner)))] = value
    else:
        bad = data.draw(HOSTILE)
    try:
        target.load_snapshot(bad)
    except StaleboundError as exc:
        assert isinstance(exc, ProtocolError), f"{type(exc).__name__}: {exc}"
        assert "snapshot" in str(exc), f"unclear: {exc}"
        assert policy_state(target) == before, "a refused load_snapshot changed the policy"
    else:  # a change it accepts must still make a consistent policy
        if isinstance(target, BufferPolicy):
            target.buffer.check_invariants()
        assert target.snapshot() == _roundtrip(target)


def _roundtrip(policy: BufferPolicy | CapacityPolicy) -> Any:
    again = _empty_like(policy)
    again.load_snapshot(copy.deepcopy(policy.snapshot()))
    return again.snapshot()


@SETTINGS
@given(st.data())
def test_constructors_refuse_bad_arguments_with_config_errors(data: st.DataObject) -> None:
    args = data.draw(st.lists(st.one_of(VERSIONS, st.integers(0, 4)), min_size=6, max_size=6))
    builders: dict[str, Callable[[], Any]] = {
        "StalenessBuffer": lambda: StalenessBuffer(
            args[0],
            args[1],
            group_size=args[2],
            buffer_size=args[3],
            group_redundancy=args[4],
            start_version=args[5],
        ),
        "GroupTracker": lambda: GroupTracker(args[0], args[1], max_relaunches=args[2]),
        "CapacityCounter": lambda: CapacityCounter(args[0], args[1], args[2]),
        "BufferPolicy": lambda: BufferPolicy(args[0], args[1]),
        "BufferPolicy_ok_buffer": lambda: BufferPolicy(StalenessBuffer(1, 1), args[1]),
        "CapacityPolicy": lambda: CapacityPolicy(
            args[0], drop_stale=args[1], start_version=args[2]
        ),
        "CapacityPolicy_ok_counter": lambda: CapacityPolicy(
            CapacityCounter(1, 1, 1), drop_stale=args[1], start_version=args[2]
        ),
    }
    name = data.draw(st.sampled_from(sorted(builders)), label="constructor")
    try:
        builders[name]()
    except ConfigError as exc:
        assert any(shows(a, str(exc)) for a in args), f"{exc} names none of {args!r}"
    # Anything else (TypeError, AttributeError, ProtocolError) fails the test.


# -- GroupTracker -----------------------------------------------------------------------------------


@st.composite
def trackers(draw: st.DrawFn) -> GroupTracker:
    n = draw(st.integers(1, 3))
    tracker = GroupTracker(n, n + draw(st.integers(0, 2)), max_relaunches=draw(st.integers(0, 2)))
    for i in range(draw(st.integers(0, 4))):
        members = list(tracker.start(f"g{i}", draw(st.integers(0, 3))))
        for m in members[: draw(st.integers(0, len(members)))]:
            if f"g{i}" not in tracker:
                break
            if draw(st.booleans()):
                tracker.finish(m, i)
            else:
                tracker.fail(m, "failed", version=3)
    return tracker


def tracker_state(tracker: GroupTracker) -> Any:
    ids = sorted(g for g in (f"g{i}" for i in range(5)) if g in tracker)
    return len(tracker), [(tracker.running(g), tracker.partial(g)) for g in ids]


@SETTINGS
@given(trackers(), st.data())
def test_group_tracker_refuses_hostile_calls_without_changing_state(
    tracker: GroupTracker, data: st.DataObject
) -> None:
    gid = data.draw(IDS | st.sampled_from([f"g{i}" for i in range(5)]), label="group_id")
    number = data.draw(VERSIONS, label="number")
    version = data.draw(VERSIONS, label="version")
    other = data.draw(HOSTILE, label="other")
    member = data.draw(
        st.one_of(st.builds(MemberId, st.just(gid), st.just(number)), HOSTILE), label="member"
    )
    calls: dict[str, tuple[Callable[[], Any], tuple[Any, ...]]] = {
        "start": (lambda: tracker.start(gid, version), (gid, version)),
        "finish": (lambda: tracker.finish(member, other), (member, gid)),
        "fail": (
            lambda: tracker.fail(member, other, version=version),
            (member, gid, other, version),
        ),
        "fail_default": (lambda: tracker.fail(member, version=version), (member, gid, version)),
        "cancel": (lambda: tracker.cancel(gid), (gid,)),
        "running": (lambda: tracker.running(gid), (gid,)),
        "partial": (lambda: tracker.partial(gid), (gid,)),
        "contains": (lambda: gid in tracker, (gid,)),
    }
    name = data.draw(st.sampled_from(sorted(calls)), label="call")
    call, bad = calls[name]
    parts = tuple(member) if isinstance(member, tuple) else ()
    assert_refused_cleanly(call, lambda: tracker_state(tracker), (*bad, *parts), lambda: None)


# -- CapacityCounter and the filters ----------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2), VERSIONS, st.data())
def test_capacity_counter_refuses_without_changing_state(
    c: int, b: int, eta: int, version: Any, data: st.DataObject
) -> None:
    counter = CapacityCounter(c, b, eta)
    for op in data.draw(
        st.lists(st.sampled_from(["enqueued", "submitted", "accepted", "rejected"]), max_size=12)
    ):
        with contextlib.suppress(ProtocolError):  # refused before any counter moved
            getattr(counter, op)()
    name = data.draw(
        st.sampled_from(["capacity", "version_recovered", "submitted", "accepted", "rejected"])
    )
    call = (
        (lambda: getattr(counter, name)(version))
        if name in ("capacity", "version_recovered")
        else getattr(counter, name)
    )
    assert_refused_cleanly(call, lambda: vars(counter.stat).copy(), (version, name), lambda: None)


@SETTINGS
@given(buffers(), VERSIONS, st.one_of(st.none(), VERSIONS), VERSIONS)
def test_proactive_filter_refuses_bad_settings(
    buf: StalenessBuffer, threshold: Any, timeout: Any, stuck_for: Any
) -> None:
    assert_refused_cleanly(
        lambda: filters.proactive_filter_targets(
            buf, threshold, stuck_for=stuck_for, stuck_timeout_s=timeout
        ),
        lambda: buffer_state(buf),
        (threshold, timeout, stuck_for),
        buf.check_invariants,
    )


@SETTINGS
@given(
    st.lists(
        st.one_of(HOSTILE, st.dictionaries(st.sampled_from(["score", "acc"]), HOSTILE, max_size=2)),
        max_size=4,
    ),
    st.one_of(st.sampled_from(filters.METRICS), HOSTILE),
)
def test_dynamic_sampling_filter_refuses_non_numbers(members: list[Any], metric: Any) -> None:
    try:
        decision = filters.dynamic_sampling_filter(members, metric)
    except ConfigError as exc:
        assert "filter_groups.metric=" in str(exc)
    else:
        assert isinstance(decision, filters.PostProcessDecision)


@SETTINGS
@given(HOSTILE)
def test_post_process_registry_refuses_bad_names_and_functions(name: Any) -> None:
    before = filters.group_post_processes()
    with pytest.raises(ConfigError, match=r"group_post_process\.name="):
        filters.get_group_post_process(name)
    with pytest.raises(ConfigError, match=r"group_post_process\.name="):
        filters.register_group_post_process("" if isinstance(name, str) else name)(
            filters.dynamic_sampling_filter
        )
    with pytest.raises(ConfigError, match="is not callable"):
        filters.register_group_post_process("fuzz_not_callable")(name)  # type: ignore[arg-type]
    assert filters.group_post_processes() == before


# -- regressions: each a bug the fuzzing found, written out ------------------------------------------


def refused(call: Callable[[], Any], kind: type[StaleboundError] = ProtocolError) -> str:
    with pytest.raises(kind) as info:
        call()
    return str(info.value)


def test_buffer_regressions() -> None:
    buf = StalenessBuffer(2, 3)
    # Was accepted: a reservation at version -2 (versions count steps from 0).
    assert refused(lambda: buf.try_reserve("x", -2)).startswith("try_reserve(version=-2)")
    # Was TypeError (unhashable): an unhashable id is simply not in flight.
    assert buf.lookup([1]) is None
    buf.try_reserve("x")
    # Was TypeError ('NoneType' object is not iterable), raised after nothing moved by luck.
    assert "segment_versions=None" in refused(lambda: buf.occupy("x", segment_versions=None))  # type: ignore[arg-type]
    assert buf.lookup("x") is not None and buf.lookup("x")[0].name == "RESERVED"  # type: ignore[index]
    # Was OverflowError out of restore().
    damaged = {**buf.snapshot(), "next_seq": math.inf}
    assert "OverflowError" in refused(lambda: StalenessBuffer.restore(damaged))


def test_capacity_policy_regressions() -> None:
    policy = CapacityPolicy(CapacityCounter(4, 2, 1))
    # Were TypeError: unhashable ids, text versions.
    assert refused(lambda: policy.try_admit([1])).startswith("try_admit(group_id=[1])")  # type: ignore[arg-type]
    assert refused(lambda: policy.abort([1])).startswith("abort(group_id=[1])")  # type: ignore[arg-type]
    assert refused(lambda: policy.try_admit("a", "x")).startswith("try_admit(version='x')")  # type: ignore[arg-type]
    assert refused(lambda: policy.capacity("x")).startswith("capacity(version='x')")  # type: ignore[arg-type]
    # Were accepted: a negative version, a float segment version, a None cause.
    assert refused(lambda: policy.try_admit("a", -3)).startswith("try_admit(version=-3)")
    policy.try_admit("a")
    assert "1.5" in refused(lambda: policy.complete("a", segment_versions=[1.5]))  # type: ignore[list-item]
    assert "cause=None" in refused(lambda: policy.abort("a", None))  # type: ignore[arg-type]
    assert policy.is_running("a") and policy.statistics().aborted == {}
    assert policy.is_running([1]) is False  # type: ignore[arg-type]
    # Were AttributeError later, or accepted: a missing counter, start_version=True.
    assert "counter=None" in refused(lambda: CapacityPolicy(None), ConfigError)  # type: ignore[arg-type]
    assert "start_version=True" in refused(
        lambda: CapacityPolicy(CapacityCounter(4, 2, 1), start_version=True), ConfigError
    )


def test_buffer_policy_regressions() -> None:
    assert "buffer=None" in refused(lambda: BufferPolicy(None), ConfigError)  # type: ignore[arg-type]
    assert "max_concurrent=True" in refused(
        lambda: BufferPolicy(StalenessBuffer(1, 1), True), ConfigError
    )
    assert BufferPolicy(StalenessBuffer(1, 1)).is_running([1]) is False  # type: ignore[arg-type]


def test_group_tracker_regressions() -> None:
    # Was accepted: True as a group size.
    assert refused(lambda: GroupTracker(True), ConfigError) == (
        "group_size=True: must be an integer ≥ 1"
    )
    tracker = GroupTracker(2)
    # Were TypeError / AttributeError, or accepted ('x' as a version).
    assert refused(lambda: tracker.start([1], 0)).startswith("start(group_id=[1])")  # type: ignore[arg-type]
    assert refused(lambda: tracker.start("a", "x")).startswith("start(version='x')")  # type: ignore[arg-type]
    assert refused(lambda: tracker.finish(None)).startswith("finish(member=None)")  # type: ignore[arg-type]
    assert [1] not in tracker
    (m0, m1) = tracker.start("a", 0)
    assert "cause=None" in refused(lambda: tracker.fail(m0, None, version=0))  # type: ignore[arg-type]
    assert tracker.running("a") == (m0, m1)


def test_counter_and_filter_regressions() -> None:
    # Were TypeError / accepted.
    assert refused(lambda: CapacityCounter(1, 1, 1).capacity("x")).startswith(
        "capacity(version='x'): "
    )  # type: ignore[arg-type]
    assert "(version=True): " in refused(lambda: CapacityCounter(1, 1, 1).version_recovered(True))
    # Were ValueError / TypeError.
    assert "'abc' is not a number" in refused(
        lambda: filters.member_metric({"score": "abc"}, "score"), ConfigError
    )
    assert "[1]" in refused(lambda: filters.get_group_post_process([1]), ConfigError)  # type: ignore[arg-type]

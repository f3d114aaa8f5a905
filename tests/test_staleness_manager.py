"""StalenessManager: AReaL's arithmetic and clamps, refusals, recovery, thread safety."""

from __future__ import annotations

import doctest
import itertools
import threading

import pytest

import stalebound
from stalebound.core import ConfigError, ProtocolError
from stalebound.runtime import RolloutStat, StalenessManager, VersionProvider
from stalebound.runtime import staleness_manager as staleness_manager_module


class Version:
    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def expected(c: int, b: int, eta: int, v: int, accepted: int, running: int) -> int:
    """AReaL's formula, written out independently of the implementation."""
    concurrency = max(1, c) - running
    staleness = (eta + v + 1) * max(1, b) - (accepted + running)
    return min(concurrency, staleness)


def drive(m: StalenessManager, accepted: int, running: int, rejected: int = 0) -> None:
    for _ in range(accepted + running + rejected):
        m.on_rollout_enqueued()
        m.on_rollout_submitted()
    for _ in range(accepted):
        m.on_rollout_accepted()
    for _ in range(rejected):
        m.on_rollout_rejected()


@pytest.mark.parametrize("c, b, eta", [(4, 2, 0), (8, 4, 2), (64, 32, 10), (3, 5, 1), (100, 1, 3)])
def test_capacity_matches_the_formula_at_many_versions(c: int, b: int, eta: int) -> None:
    for v, accepted, running in itertools.product(range(0, 12, 3), range(0, 30, 7), range(0, 9, 4)):
        clock = Version(v)
        m = StalenessManager(clock, c, b, eta)
        drive(m, accepted, running, rejected=2)
        assert m.get_capacity() == expected(c, b, eta, v, accepted, running), (v, accepted, running)
        # the version is read at every call, not cached
        clock.version = v + 5
        assert m.get_capacity() == expected(c, b, eta, v + 5, accepted, running)


def test_capacity_may_be_negative() -> None:
    m = StalenessManager(
        Version(0), max_concurrent_rollouts=2, consumer_batch_size=1, max_staleness=0
    )
    drive(m, accepted=3, running=0)
    assert m.get_capacity() == 1 - 3


@pytest.mark.parametrize("c, b", [(0, 4), (4, 0), (0, 0)])
def test_zero_limits_clamp_to_one(c: int, b: int) -> None:
    m = StalenessManager(Version(2), c, b, max_staleness=1)
    assert m.get_capacity() == min(max(1, c), (1 + 2 + 1) * max(1, b))
    assert m.get_capacity() == expected(c, b, 1, 2, 0, 0)


def test_pending_limit() -> None:
    assert StalenessManager(Version(), 8, 4, 2).get_pending_limit() == (2 + 1) * 4
    assert StalenessManager(Version(), 8, 32, 10).get_pending_limit() == 11 * 32


def test_invalid_settings_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        StalenessManager(Version(), -1, -2, -3)
    assert len(info.value.problems) == 3
    assert "max_staleness=-3" in str(info.value)


# the callback, the counter it takes a rollout from, the counter it moves it to
MOVES = [
    ("on_rollout_submitted", "enqueued", "running"),
    ("on_rollout_accepted", "running", "accepted"),
    ("on_rollout_rejected", "running", "rejected"),
]


@pytest.mark.parametrize("callback, source, target", MOVES)
def test_strict_refuses_a_callback_out_of_order_and_changes_nothing(
    callback: str, source: str, target: str
) -> None:
    m = StalenessManager(Version(), 4, 2, 1, strict=True)
    drive(m, accepted=1, running=0, rejected=1)
    before = m.get_stats()
    with pytest.raises(ProtocolError) as info:
        getattr(m, callback)()
    assert str(info.value) == (
        f"{callback}(): no rollout is {source} "
        "(RolloutStat(accepted=1, enqueued=0, rejected=1, running=0)); each rollout must be "
        "enqueued, then submitted, then accepted or rejected, once each"
    )
    assert m.get_stats() == before and m.protocol_violations == 0


@pytest.mark.parametrize("callback, source, target", MOVES)
def test_by_default_a_callback_out_of_order_moves_the_counters_as_areal_does(
    callback: str, source: str, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    m = StalenessManager(Version(), 4, 2, 1)
    drive(m, accepted=1, running=0, rejected=1)
    for n in (1, 2, 3):
        getattr(m, callback)()
        stats = m.get_stats()
        assert getattr(stats, source) == -n  # below zero, as AReaL's counters go
        assert getattr(stats, target) == {"accepted": 1, "rejected": 1, "running": 0}[target] + n
        assert m.protocol_violations == n
    assert [r.getMessage() for r in caplog.records] == [  # one warning, not one per call
        f"StalenessManager.{callback}(): no rollout was {source}, so {source} is now -1 (as "
        "AReaL's manager does); the callbacks are out of order — each rollout must be enqueued, "
        "then submitted, then accepted or rejected. Further such calls are only counted "
        "(protocol_violations); strict=True raises instead"
    ]
    assert "protocol_violations=3" in repr(m)
    # an in-order call is never counted
    m.on_rollout_enqueued()
    assert m.protocol_violations == 3


def test_lifecycle_counters() -> None:
    m = StalenessManager(Version(), 4, 2, 1)
    m.on_rollout_enqueued()
    m.on_rollout_enqueued()
    assert m.get_stats() == RolloutStat(accepted=0, enqueued=2, rejected=0, running=0)
    m.on_rollout_submitted()
    m.on_rollout_submitted()
    m.on_rollout_accepted()
    m.on_rollout_rejected()
    assert m.get_stats() == RolloutStat(accepted=1, enqueued=0, rejected=1, running=0)


def test_get_stats_is_a_copy() -> None:
    m = StalenessManager(Version(), 4, 2, 1)
    stats = m.get_stats()
    stats.accepted = 99
    assert m.get_stats().accepted == 0


def test_rollout_stat_is_the_live_counters_under_areals_name() -> None:
    m = StalenessManager(Version(), 4, 2, 1)
    m.on_rollout_enqueued()
    with m.lock:
        assert m.rollout_stat is m.counter.stat and m.rollout_stat.enqueued == 1


def test_version_recovery_counts_trained_batches_as_accepted() -> None:
    fresh = StalenessManager(Version(0), 16, 4, 2)
    resumed = StalenessManager(Version(7), 16, 4, 2)
    resumed.on_version_recovered(7)
    assert resumed.get_stats().accepted == 7 * 4
    # resuming at version 7 leaves the same room as starting fresh at version 0
    assert resumed.get_capacity() == fresh.get_capacity() == min(16, 3 * 4)
    with pytest.raises(ProtocolError, match="-1"):
        resumed.on_version_recovered(-1)
    assert resumed.get_stats().accepted == 7 * 4


def test_threads_hammering_callbacks_lose_nothing() -> None:
    m = StalenessManager(Version(0), 1000, 1000, 0)
    threads, rounds = 8, 2000
    barrier = threading.Barrier(threads)
    seen: list[int] = []

    def worker(i: int) -> None:
        barrier.wait()
        for k in range(rounds):
            m.on_rollout_enqueued()
            m.on_rollout_submitted()
            seen.append(m.get_capacity())
            if (i + k) % 3:
                m.on_rollout_accepted()
            else:
                m.on_rollout_rejected()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    total = threads * rounds
    rejected = sum(1 for i in range(threads) for k in range(rounds) if (i + k) % 3 == 0)
    assert m.get_stats() == RolloutStat(
        accepted=total - rejected, enqueued=0, rejected=rejected, running=0
    )
    # every reading saw a consistent state: never more running than started
    assert all(cap <= 1000 for cap in seen)


def test_version_provider_protocol() -> None:
    assert isinstance(Version(), VersionProvider)
    assert not isinstance(object(), VersionProvider)


def test_seed_smooth_version_provider() -> None:
    """The seed's custom provider, as written there: an EMA of the engine's version."""

    class Engine:
        version = 0

        def get_version(self) -> int:
            return self.version

    class SmoothVersionProvider:
        def __init__(self, engine, smoothing_factor=0.9):  # type: ignore[no-untyped-def]
            self.engine = engine
            self.smooth_version = 0.0
            self.alpha = smoothing_factor

        def get_version(self) -> int:
            raw_version = self.engine.get_version()
            self.smooth_version = self.alpha * self.smooth_version + (1 - self.alpha) * raw_version
            return int(self.smooth_version)

    inference_engine = Engine()
    custom_manager = StalenessManager(
        version_provider=SmoothVersionProvider(inference_engine),
        max_concurrent_rollouts=64,
        consumer_batch_size=32,
        max_staleness=10,
    )
    assert custom_manager.get_capacity() == 64
    drive(custom_manager, accepted=350, running=0)
    inference_engine.version = 10
    # the smoothed version lags the engine's, so the staleness limit stays tighter for a while
    caps = [custom_manager.get_capacity() for _ in range(40)]
    # first smoothed version: int(0.9·0 + (1 − 0.9)·10) is 0 in floating point
    assert caps[0] == (10 + 0 + 1) * 32 - 350
    assert caps == sorted(caps)
    assert caps[-1] == 64


def test_module_example_runs() -> None:
    failed, attempted = doctest.testmod(staleness_manager_module)
    assert attempted > 5
    assert failed == 0


def test_top_level_exports_are_the_runtime_classes() -> None:
    assert stalebound.StalenessManager is StalenessManager
    assert stalebound.RolloutStat is RolloutStat
    assert stalebound.VersionProvider is VersionProvider
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = stalebound.no_such_name

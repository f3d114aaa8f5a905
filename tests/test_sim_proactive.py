"""The proactive filter's decision: the core's targets plus the simulator's two guards."""

from __future__ import annotations

import pytest

from stalebound.core import BufferState, ConfigError, StalenessBuffer
from stalebound.sim.proactive import FilterAction, decide


def stuck_head(later_occupied: int) -> StalenessBuffer:
    """B = 2, η = 1: buffer 0 holds one occupied and one reserved group ("slow")."""
    buf = StalenessBuffer(batch_size=2, staleness=1)
    for gid in ("a", "b", "slow", "d"):
        buf.try_reserve(gid)  # a, b -> buffer 1; slow, d -> buffer 0
    buf.occupy("d")  # -> buffer 0
    for gid in ("a", "b")[:later_occupied]:
        buf.occupy(gid)  # buffer 0 has no EMPTY entry left: they stay in buffer 1
    assert buf.state(0) is BufferState.STUCK
    assert buf.reserved_groups(0) == ("slow",)
    return buf


def test_truncate_acts_on_a_stuck_head_when_the_trainer_waits() -> None:
    buf = stuck_head(0)
    assert decide("truncate", buf, threshold=1, stuck_for=0.0) == FilterAction(
        "truncate", ("slow",)
    )
    assert decide("truncate", buf, threshold=1, stuck_for=0.0, trainer_idle=False) is None
    assert decide("truncate", buf, threshold=1, stuck_for=1.0, stuck_time=5.0) is None
    assert decide("truncate", buf, threshold=1, stuck_for=6.0, stuck_time=5.0) is not None


def test_retry_waits_until_pulling_forward_can_fill_the_head() -> None:
    assert decide("retry", stuck_head(0), threshold=1, stuck_for=0.0) is None
    buf = stuck_head(1)
    assert decide("retry", buf, threshold=1, stuck_for=0.0) == FilterAction("retry", ("slow",))


def test_nothing_to_do_unless_stuck() -> None:
    buf = StalenessBuffer(batch_size=2, staleness=1)
    buf.try_reserve("a")
    assert decide("truncate", buf, threshold=4, stuck_for=0.0) is None


def test_unknown_method_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="method='drop'"):
        decide("drop", stuck_head(0), threshold=1, stuck_for=0.0)

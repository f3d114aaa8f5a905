"""The proactive filter's pure decision."""

from __future__ import annotations

import pytest

from stalebound.core import BufferState, ConfigError
from stalebound.sim.proactive import FilterAction, decide


def test_acts_only_on_a_stuck_head_with_few_reservations_and_an_idle_trainer() -> None:
    kw = {"threshold": 2, "stuck_for": 1.0}
    assert decide("truncate", BufferState.STUCK, ("a", "b"), **kw) == FilterAction(
        "truncate", ("a", "b")
    )
    assert decide("truncate", BufferState.PENDING, ("a",), **kw) is None
    assert decide("truncate", BufferState.STUCK, ("a", "b", "c"), **kw) is None
    assert decide("truncate", BufferState.STUCK, ("a",), trainer_idle=False, **kw) is None
    assert decide("truncate", BufferState.STUCK, ("a",), stuck_time=5.0, **kw) is None


def test_retry_waits_until_pulling_forward_can_fill_the_head() -> None:
    kw = {"threshold": 2, "stuck_for": 0.0, "missing": 2}
    assert decide("retry", BufferState.STUCK, ("a", "b"), pullable=1, **kw) is None
    assert decide("retry", BufferState.STUCK, ("a", "b"), pullable=2, **kw) == FilterAction(
        "retry", ("a", "b")
    )


def test_unknown_method_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="method='drop'"):
        decide("drop", BufferState.STUCK, ("a",), threshold=1, stuck_for=0.0)

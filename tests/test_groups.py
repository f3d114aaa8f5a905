"""Group sampling: N′ members launched, complete at N, relaunch on failure."""

from __future__ import annotations

import pytest

from stalebound import (
    ConfigError,
    GroupComplete,
    GroupFailed,
    GroupTracker,
    MemberId,
    ProtocolError,
    Relaunch,
)


def test_group_completes_at_n_and_returns_the_surplus_to_abort() -> None:
    t = GroupTracker(group_size=2, group_redundancy=4)
    members = t.start("p", version=3)
    assert members == tuple(MemberId("p", i) for i in range(4))
    assert t.finish(members[2], "r2") is None
    done = t.finish(members[0], "r0")
    assert isinstance(done, GroupComplete)
    assert [(m.member.number, m.version, m.result) for m in done.members] == [
        (2, 3, "r2"),
        (0, 3, "r0"),
    ]
    assert done.surplus == (MemberId("p", 1), MemberId("p", 3))
    assert "p" not in t


def test_failure_covered_by_redundancy_needs_no_relaunch() -> None:
    t = GroupTracker(group_size=2, group_redundancy=3)
    a, b, c = t.start("p", version=0)
    assert t.fail(a, "timeout", version=1) is None
    t.finish(b)
    assert isinstance(t.finish(c), GroupComplete)


def test_failed_member_is_relaunched_at_the_current_version_until_the_budget_is_spent() -> None:
    t = GroupTracker(group_size=2, max_relaunches=1)
    a, b = t.start("p", version=0)
    relaunch = t.fail(a, "error", version=2)
    assert relaunch == Relaunch(MemberId("p", 2), 2)
    failed = t.fail(relaunch.member, "error again", version=2)  # type: ignore[union-attr]
    assert failed == GroupFailed("p", ("error", "error again"), (b,))
    assert len(t) == 0


def test_relaunched_member_keeps_its_own_version_in_the_result() -> None:
    t = GroupTracker(group_size=2)
    a, b = t.start("p", version=0)
    r = t.fail(a, version=1)
    assert isinstance(r, Relaunch)
    t.finish(b)
    done = t.finish(r.member)
    assert isinstance(done, GroupComplete)
    assert [m.version for m in done.members] == [0, 1]


def test_cancel_and_misuse() -> None:
    t = GroupTracker(group_size=1, group_redundancy=2)
    a, b = t.start("p", version=0)
    with pytest.raises(ProtocolError, match=r"start\(group_id='p'\): the group is already running"):
        t.start("p", version=0)
    t.fail(a, version=0)
    with pytest.raises(ProtocolError, match="the member is not running"):
        t.finish(a)
    assert t.cancel("p") == (b,)
    with pytest.raises(ProtocolError, match=r"finish\(group_id='p'\): no such group running"):
        t.finish(b)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError) as info:
        GroupTracker(group_size=0, group_redundancy=None, max_relaunches=-1)
    assert len(info.value.problems) == 2
    with pytest.raises(ConfigError, match="group_redundancy=2: must be an integer ≥ group_size=3"):
        GroupTracker(group_size=3, group_redundancy=2)

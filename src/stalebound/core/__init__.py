"""The pure staleness-control core: standard library only, no threads, clocks or IO.

Every driver (the asyncio runtime, the simulator, the Ray coordinator) talks to staleness control
through this package's public names alone.
"""

from stalebound.core.buffer import (
    BufferState,
    BufferStatistics,
    ConsumedBatch,
    ConsumedGroup,
    EntryState,
    Reservation,
    StalenessBuffer,
)
from stalebound.core.capacity import CapacityCounter, RolloutStat
from stalebound.core.errors import ConfigError, InvariantError, ProtocolError, StaleboundError
from stalebound.core.groups import (
    GroupComplete,
    GroupFailed,
    GroupTracker,
    MemberId,
    MemberResult,
    Relaunch,
)
from stalebound.core.policy import (
    Admission,
    BufferPolicy,
    CapacityPolicy,
    PolicyStatistics,
    StalenessPolicy,
)

__all__ = [
    "Admission",
    "BufferPolicy",
    "BufferState",
    "BufferStatistics",
    "CapacityCounter",
    "CapacityPolicy",
    "ConfigError",
    "ConsumedBatch",
    "ConsumedGroup",
    "EntryState",
    "GroupComplete",
    "GroupFailed",
    "GroupTracker",
    "InvariantError",
    "MemberId",
    "MemberResult",
    "PolicyStatistics",
    "ProtocolError",
    "Relaunch",
    "Reservation",
    "RolloutStat",
    "StaleboundError",
    "StalenessBuffer",
    "StalenessPolicy",
]

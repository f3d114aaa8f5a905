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
from stalebound.core.coordinator import (
    AdmissionGate,
    Coordinator,
    CoordinatorCounts,
    DeadlinePolicy,
)
from stalebound.core.errors import (
    ConfigError,
    DataExhausted,
    InvariantError,
    ProtocolError,
    StaleboundError,
)
from stalebound.core.groups import (
    GroupComplete,
    GroupFailed,
    GroupTracker,
    MemberId,
    MemberResult,
    Relaunch,
)
from stalebound.core.names import (
    Cause,
    Outcome,
    PolicyKind,
    ProactiveMethod,
    Timer,
    Verdict,
)
from stalebound.core.policy import (
    Admission,
    BufferPolicy,
    CapacityPolicy,
    PolicyStatistics,
    StalenessPolicy,
)
from stalebound.core.settings import (
    DEFAULT_BATCHES_IN_FLIGHT,
    CoordinatorSettings,
    build_policy,
    resolve_settings,
)
from stalebound.core.transitions import (
    ENTRY_TRANSITIONS,
    GROUP_TRANSITIONS,
    EntryOp,
    GroupOp,
    GroupState,
)

__all__ = [
    "DEFAULT_BATCHES_IN_FLIGHT",
    "ENTRY_TRANSITIONS",
    "GROUP_TRANSITIONS",
    "Admission",
    "AdmissionGate",
    "BufferPolicy",
    "BufferState",
    "BufferStatistics",
    "CapacityCounter",
    "CapacityPolicy",
    "Cause",
    "ConfigError",
    "ConsumedBatch",
    "ConsumedGroup",
    "Coordinator",
    "CoordinatorCounts",
    "CoordinatorSettings",
    "DataExhausted",
    "DeadlinePolicy",
    "EntryOp",
    "EntryState",
    "GroupComplete",
    "GroupFailed",
    "GroupOp",
    "GroupState",
    "GroupTracker",
    "InvariantError",
    "MemberId",
    "MemberResult",
    "Outcome",
    "PolicyKind",
    "PolicyStatistics",
    "ProactiveMethod",
    "ProtocolError",
    "Relaunch",
    "Reservation",
    "RolloutStat",
    "StaleboundError",
    "StalenessBuffer",
    "StalenessPolicy",
    "Timer",
    "Verdict",
    "build_policy",
    "resolve_settings",
]

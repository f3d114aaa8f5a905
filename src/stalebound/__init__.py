"""stalebound: bounded-staleness asynchronous RL training for language models.

``import stalebound`` loads the pure core only; engines, training, Ray and plotting are imported
from their subpackages when used.
"""

from stalebound.core import (
    BufferState,
    BufferStatistics,
    ConfigError,
    ConsumedBatch,
    ConsumedGroup,
    EntryState,
    GroupComplete,
    GroupFailed,
    GroupTracker,
    InvariantError,
    MemberId,
    MemberResult,
    ProtocolError,
    Relaunch,
    Reservation,
    StaleboundError,
    StalenessBuffer,
)

__version__ = "0.1.0"

__all__ = [
    "BufferState",
    "BufferStatistics",
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
    "ProtocolError",
    "Relaunch",
    "Reservation",
    "StaleboundError",
    "StalenessBuffer",
    "__version__",
]

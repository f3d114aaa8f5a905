"""stalebound: bounded-staleness asynchronous RL training for language models.

``import stalebound`` loads the pure core only; engines, training, Ray and plotting are imported
from their subpackages when used.
"""

from typing import TYPE_CHECKING

from stalebound._lazy import lazy_attributes
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

if TYPE_CHECKING:
    from stalebound.runtime import (
        EpisodeTruncated,
        RolloutStat,
        StalenessManager,
        VersionProvider,
        WorkflowExecutor,
        interruptible,
    )

__version__ = "0.1.0"

# The runtime (asyncio, threads) loads on first use, so `import stalebound` stays light.
__getattr__ = lazy_attributes(
    __name__,
    dict.fromkeys(
        (
            "EpisodeTruncated",
            "RolloutStat",
            "StalenessManager",
            "VersionProvider",
            "WorkflowExecutor",
            "interruptible",
        ),
        "runtime",
    ),
)


__all__ = [
    "BufferState",
    "BufferStatistics",
    "ConfigError",
    "ConsumedBatch",
    "ConsumedGroup",
    "EntryState",
    "EpisodeTruncated",
    "GroupComplete",
    "GroupFailed",
    "GroupTracker",
    "InvariantError",
    "MemberId",
    "MemberResult",
    "ProtocolError",
    "Relaunch",
    "Reservation",
    "RolloutStat",
    "StaleboundError",
    "StalenessBuffer",
    "StalenessManager",
    "VersionProvider",
    "WorkflowExecutor",
    "__version__",
    "interruptible",
]

"""The asyncio runtime: AReaL's ``StalenessManager`` and the ``WorkflowExecutor`` that drives a
staleness policy with real rollout workflows."""

from stalebound.runtime.cut import EpisodeTruncated, interruptible
from stalebound.runtime.executor import (
    ExecutorStatistics,
    RolloutError,
    Trajectory,
    WorkflowExecutor,
    WorkflowProtocol,
)
from stalebound.runtime.staleness_manager import RolloutStat, StalenessManager, VersionProvider

__all__ = [
    "EpisodeTruncated",
    "ExecutorStatistics",
    "RolloutError",
    "RolloutStat",
    "StalenessManager",
    "Trajectory",
    "VersionProvider",
    "WorkflowExecutor",
    "WorkflowProtocol",
    "interruptible",
]

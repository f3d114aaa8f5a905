"""stalebound: bounded-staleness asynchronous RL training for language models.

``import stalebound`` loads the pure core only; engines, training, Ray and plotting are imported
from their subpackages when used.

Running a job from Python (docs/data.md, "From Python")::

    import stalebound

    cfg = stalebound.train_config(["my.yaml", "rollout.workflow=my_workflow.py:Agent"])
    result = stalebound.run_training(cfg)

:func:`train_config` reads what ``stalebound train`` would (the train recipe, YAML files, then
``key=value`` overrides); :func:`load_config` reads a config without the recipe. A workflow
implements :class:`Workflow` (``async arun_episode(engine, row)``) against a
:class:`WorkflowEngine` and returns a :class:`Trajectory`; a reward is a plain function
``reward(prompt, completion, **columns)`` (:class:`RewardFunction` runs one).
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
    from stalebound.config import StaleboundConfig, load_config
    from stalebound.rewards import RewardFunction
    from stalebound.runtime import (
        EpisodeTruncated,
        RolloutStat,
        StalenessManager,
        VersionProvider,
        WorkflowExecutor,
        interruptible,
    )
    from stalebound.tasks import (
        EpisodeEngine,
        EpisodeFailed,
        Sample,
        Task,
        Trajectory,
        Workflow,
        WorkflowEngine,
        register_task,
    )

__version__ = "0.1.0"

# The runtime (asyncio, threads), the tasks and the trainer load on first use, so
# `import stalebound` stays light. (The trainer's names are left out of the TYPE_CHECKING imports
# above: the trainer imports this package for its version, and imports go one way.)
__getattr__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(
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
        **dict.fromkeys(
            (
                "EpisodeEngine",
                "EpisodeFailed",
                "Sample",
                "Task",
                "Trajectory",
                "Workflow",
                "WorkflowEngine",
                "register_task",
            ),
            "tasks",
        ),
        "StaleboundConfig": "config",
        "load_config": "config",
        "RewardFunction": "rewards",
        "TrainResult": "train.outcome",
        "train_config": "train.preflight",
        "run_training": "train.recipe",
    },
)


__all__ = [
    "BufferState",
    "BufferStatistics",
    "ConfigError",
    "ConsumedBatch",
    "ConsumedGroup",
    "EntryState",
    "EpisodeEngine",
    "EpisodeFailed",
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
    "RewardFunction",
    "RolloutStat",
    "Sample",
    "StaleboundConfig",
    "StaleboundError",
    "StalenessBuffer",
    "StalenessManager",
    "Task",
    "TrainResult",
    "Trajectory",
    "VersionProvider",
    "Workflow",
    "WorkflowEngine",
    "WorkflowExecutor",
    "__version__",
    "interruptible",
    "load_config",
    "register_task",
    "run_training",
    "train_config",
]

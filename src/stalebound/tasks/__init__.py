"""Built-in verifiable tasks, their reward functions and episode workflows (no torch needed).

Built in: ``arithmetic`` (``12+7=`` → ``19``), ``strings`` (``reverse abc?`` → ``cba``) and the
agentic ``calculator`` (tool calls with heavy-tailed latency). Add your own with
:func:`register_task`. Every prompt and answer stays within :data:`CHARSET`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalebound._lazy import lazy_attributes

if TYPE_CHECKING:  # the names below, for the type checker (they load lazily)
    from stalebound.tasks.arithmetic import ArithmeticTask
    from stalebound.tasks.base import (
        Task,
        TaskFactory,
        builtin_data_path,
        list_tasks,
        load_samples,
        make_task,
        register_task,
    )
    from stalebound.tasks.calculator import CalculatorTask, CalculatorWorkflow
    from stalebound.tasks.charset import CHARSET, check_text
    from stalebound.tasks.config import (
        ArithmeticConfig,
        CalculatorConfig,
        LatencyConfig,
        RewardLatencyConfig,
        StringsConfig,
        TaskConfig,
    )
    from stalebound.tasks.dataset import DataTask, DataWorkflow, EpisodeFailed, build_task
    from stalebound.tasks.episode import (
        GenerateFn,
        Generation,
        Sample,
        TokenizerLike,
        Trajectory,
        Turn,
        Workflow,
        WorkflowEngine,
    )
    from stalebound.tasks.latency import latency_problems, sample_latency
    from stalebound.tasks.strings import StringsTask
    from stalebound.tasks.workflow import (
        EpisodeEngine,
        SingleTurnWorkflow,
        as_workflow,
        decode_text,
        encode_chat,
        encode_prompt,
        encode_text,
        encode_tool_reply,
    )

__all__ = [
    "CHARSET",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CalculatorConfig",
    "CalculatorTask",
    "CalculatorWorkflow",
    "DataTask",
    "DataWorkflow",
    "EpisodeEngine",
    "EpisodeFailed",
    "GenerateFn",
    "Generation",
    "LatencyConfig",
    "RewardLatencyConfig",
    "Sample",
    "SingleTurnWorkflow",
    "StringsConfig",
    "StringsTask",
    "Task",
    "TaskConfig",
    "TaskFactory",
    "TokenizerLike",
    "Trajectory",
    "Turn",
    "Workflow",
    "WorkflowEngine",
    "as_workflow",
    "build_task",
    "builtin_data_path",
    "check_text",
    "decode_text",
    "encode_chat",
    "encode_prompt",
    "encode_text",
    "encode_tool_reply",
    "latency_problems",
    "list_tasks",
    "load_samples",
    "make_task",
    "register_task",
    "sample_latency",
]

# Names load on first use, so that importing the task settings (``stalebound.tasks.config``, as the
# config tree does) loads no task. The registry loads the built-in tasks itself when first asked.
_LAZY = {
    "ArithmeticConfig": "config",
    "ArithmeticTask": "arithmetic",
    "CHARSET": "charset",
    "CalculatorConfig": "config",
    "CalculatorTask": "calculator",
    "CalculatorWorkflow": "calculator",
    "DataTask": "dataset",
    "DataWorkflow": "dataset",
    "EpisodeEngine": "workflow",
    "EpisodeFailed": "dataset",
    "build_task": "dataset",
    "GenerateFn": "episode",
    "Generation": "episode",
    "LatencyConfig": "config",
    "RewardLatencyConfig": "config",
    "Sample": "episode",
    "SingleTurnWorkflow": "workflow",
    "StringsConfig": "config",
    "StringsTask": "strings",
    "Task": "base",
    "TaskConfig": "config",
    "TaskFactory": "base",
    "TokenizerLike": "episode",
    "Trajectory": "episode",
    "Turn": "episode",
    "Workflow": "episode",
    "WorkflowEngine": "episode",
    "as_workflow": "workflow",
    "builtin_data_path": "base",
    "check_text": "charset",
    "decode_text": "workflow",
    "encode_chat": "workflow",
    "encode_prompt": "workflow",
    "encode_text": "workflow",
    "encode_tool_reply": "workflow",
    "latency_problems": "latency",
    "list_tasks": "base",
    "load_samples": "base",
    "make_task": "base",
    "register_task": "base",
    "sample_latency": "latency",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

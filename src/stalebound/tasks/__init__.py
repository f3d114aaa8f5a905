"""Built-in verifiable tasks, their reward functions and episode workflows (no torch needed).

Built in: ``arithmetic`` (``12+7=`` → ``19``), ``strings`` (``reverse abc?`` → ``cba``) and the
agentic ``calculator`` (tool calls with heavy-tailed latency). Add your own with
:func:`register_task`. Every prompt and answer stays within :data:`CHARSET`.
"""

from stalebound.tasks.arithmetic import ArithmeticTask
from stalebound.tasks.base import (
    Sample,
    Task,
    TaskFactory,
    Trajectory,
    Turn,
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
from stalebound.tasks.latency import latency_problems, sample_latency
from stalebound.tasks.strings import StringsTask
from stalebound.tasks.workflow import (
    GenerateFn,
    Generation,
    SingleTurnWorkflow,
    TokenizerLike,
    Workflow,
    decode_text,
    encode_prompt,
    encode_text,
)

__all__ = [
    "CHARSET",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CalculatorConfig",
    "CalculatorTask",
    "CalculatorWorkflow",
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
    "builtin_data_path",
    "check_text",
    "decode_text",
    "encode_prompt",
    "encode_text",
    "latency_problems",
    "list_tasks",
    "load_samples",
    "make_task",
    "register_task",
    "sample_latency",
]

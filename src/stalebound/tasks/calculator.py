"""The agentic ``calculator`` task: ``a*b+c?`` solved with a calculator tool, over several turns.

An episode (each model turn ends with the end-of-sequence token)::

    prompt   37*24+15?
    model    [37*24]          a tool call: one integer operation in brackets
    tool     =888;            after a heavy-tailed latency (real ``asyncio.sleep``)
    model    [888+15]
    tool     =903;
    model    903              no brackets: the final answer

The tool evaluates ``int op int`` with ``op`` in ``+ - *`` and answers ``=err;`` to anything else.
Tool turns are inserted into the trajectory with ``loss_mask`` 0: with a tokenizer that has a chat
template, as ``tool`` messages rendered by the template (which also opens the next assistant
turn); with the built-in character tokenizer, as the plain text above. The reward is the arithmetic
task's: exact match of the final answer (partial credit by digits when enabled); an episode that
runs out of turns or tokens is truncated and scores 0, and so is one cut during a tool call (the
tool waits through :func:`~stalebound.runtime.interruptible`, so a truncation at a deadline ends it
at once). The metrics add ``tool_calls`` and ``tool_wait_s`` (the waits that ran to the end).
"""

from __future__ import annotations

import asyncio
import random
import re

from stalebound.core.errors import ConfigError
from stalebound.runtime.cut import EpisodeTruncated, interruptible
from stalebound.tasks.arithmetic import digit_credit
from stalebound.tasks.base import Sample, Task, Trajectory, Turn, register_task
from stalebound.tasks.config import TaskConfig
from stalebound.tasks.episode import WorkflowEngine
from stalebound.tasks.latency import latency_problems, sample_latency
from stalebound.tasks.workflow import (
    TokenizerLike,
    Workflow,
    decode_text,
    encode_tool_reply,
)

__all__ = ["CalculatorTask", "CalculatorWorkflow", "calculate", "parse_tool_call"]

_CALL = re.compile(r"^\[(.*)\]$")
_EXPR = re.compile(r"^(\d{1,9})([+\-*])(\d{1,9})$")


def parse_tool_call(text: str) -> str | None:
    """The expression inside a ``[...]`` turn, or ``None`` if the turn is not a tool call."""
    m = _CALL.match(text.strip())
    return m.group(1) if m else None


def calculate(expr: str) -> str:
    """The tool's reply to ``expr``: ``=value;`` for ``int op int`` (``op`` in ``+ - *``), else
    ``=err;``."""
    m = _EXPR.match(expr.replace(" ", ""))
    if m is None:
        return "=err;"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"={value};"


@register_task("calculator")
class CalculatorTask(Task):
    """``a*b+c`` with a calculator tool; see the module docstring."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__(config)
        c = config.calculator
        problems = latency_problems(c.latency, "task.calculator.latency")
        if c.max_turns < 1:
            problems.append(f"task.calculator.max_turns={c.max_turns}: must be >= 1")
        if not 2 <= c.max_operand <= 9999:
            problems.append(f"task.calculator.max_operand={c.max_operand}: must be in 2..9999")
        if problems:
            raise ConfigError(problems)

    def generate(self, rng: random.Random, index: int) -> Sample:
        hi = self.config.calculator.max_operand
        a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(2, hi)
        return Sample(str(index), f"{a}*{b}+{c}", str(a * b + c), {"a": a, "b": b, "c": c})

    def prompt(self, sample: Sample) -> str:
        return f"{sample.question}?"

    def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
        m = re.fullmatch(r"(\d+)\*(\d+)\+(\d+)", sample.question)
        if m is None:
            return (Turn(sample.answer),)
        a, b, c = (int(g) for g in m.groups())
        return (
            Turn(f"[{a}*{b}]"),
            Turn(calculate(f"{a}*{b}"), "tool"),
            Turn(f"[{a * b}+{c}]"),
            Turn(calculate(f"{a * b}+{c}"), "tool"),
            Turn(sample.answer),
        )

    def reward(self, sample: Sample, response: str) -> float:
        if response == sample.answer:
            return 1.0
        return 0.5 * digit_credit(sample.answer, response) if self.config.partial_credit else 0.0

    def workflow(self, tokenizer: TokenizerLike) -> Workflow:
        return CalculatorWorkflow(self, tokenizer)

    def latency_rng(self, sample: Sample, call: int) -> random.Random:
        """The rng of tool call number ``call`` of ``sample``: the same run waits the same."""
        return random.Random(f"{self.config.seed}:{sample.id}:{call}")


class CalculatorWorkflow:
    """Runs a calculator episode (see the module docstring) on any engine."""

    def __init__(self, task: CalculatorTask, tokenizer: TokenizerLike) -> None:
        self.task = task
        self.tokenizer = tokenizer

    async def arun_episode(self, engine: WorkflowEngine, row: Sample) -> Trajectory:
        sample = row
        cfg = self.task.config
        prompt_ids = self.task.encode(self.tokenizer, sample)
        messages = [{"role": "user", "content": self.task.prompt(sample)}]
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        answer = ""
        truncated = True
        calls = 0
        waited = 0.0
        for _ in range(cfg.calculator.max_turns):
            gen = await engine.agenerate(prompt_ids + out)
            out += list(gen.output_ids)
            logprobs += [float(x) for x in gen.output_logprobs]
            versions += [int(v) for v in gen.output_versions]
            mask += [1] * len(gen.output_ids)
            if gen.finish_reason != "stop":
                break
            text = decode_text(self.tokenizer, gen.output_ids)
            expr = parse_tool_call(text)
            if expr is None:
                answer, truncated = text, False
                break
            delay = sample_latency(cfg.calculator.latency, self.task.latency_rng(sample, calls))
            calls += 1
            try:
                await interruptible(asyncio.sleep(delay))
            except EpisodeTruncated:  # cut at a deadline during the tool call: as it stands
                break
            waited += delay
            messages.append({"role": "assistant", "content": text})
            result = calculate(expr)
            reply = encode_tool_reply(self.tokenizer, messages, result)
            messages.append({"role": "tool", "content": result})
            last_version = versions[-1] if versions else 0
            out += reply
            logprobs += [0.0] * len(reply)
            versions += [last_version] * len(reply)
            mask += [0] * len(reply)
        metrics = await self.task.score(sample, answer, truncated=truncated)
        metrics["tool_calls"] = float(calls)
        metrics["tool_wait_s"] = waited
        return Trajectory(
            prompt_ids=prompt_ids,
            output_ids=out,
            behaviour_logprobs=logprobs,
            versions=versions,
            reward=metrics["score"],
            truncated=truncated,
            loss_mask=mask,
            sample_id=sample.id,
            response=answer,
            metrics=metrics,
        )

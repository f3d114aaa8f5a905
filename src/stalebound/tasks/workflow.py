"""Episode runners that work over any engine, and the engine a workflow sees.

A workflow turns one row (a :class:`~stalebound.tasks.episode.Sample`) into one
:class:`~stalebound.tasks.episode.Trajectory`: ``await workflow.arun_episode(engine, row)``.
``engine`` is a :class:`~stalebound.tasks.episode.WorkflowEngine` — here :class:`EpisodeEngine`,
one per episode — whose ``agenerate(prompt, max_new_tokens=..., stop_token_ids=...)`` runs one
model turn from token ids or chat messages and answers ``input_ids``, ``output_ids``,
``output_logprobs``, ``output_versions`` and ``finish_reason`` (``stop`` | ``length`` | ``abort``);
``engine.tokenizer`` encodes and decodes, ``engine.score(row, completion)`` is the run's reward.

The stop token (end of turn) is part of ``output_ids`` and is trained on, so the policy learns when
to stop. A workflow written for the earlier interface, ``run(generate, sample)``, still runs
through :func:`as_workflow`, which warns that it is deprecated.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.tasks.episode import (
    EpisodeTask,
    GenerateFn,
    Generation,
    LegacyWorkflow,
    Prompt,
    Sample,
    TokenizerLike,
    Trajectory,
    Workflow,
    WorkflowEngine,
)

__all__ = [
    "EpisodeEngine",
    "GenerateFn",
    "Generated",
    "Generation",
    "SingleTurnWorkflow",
    "TokenizerLike",
    "Workflow",
    "as_workflow",
    "await_reward",
    "context_problems",
    "decode_text",
    "encode_chat",
    "encode_prompt",
    "encode_text",
    "encode_tool_reply",
    "eos_id",
    "stop_ids",
    "vocabulary_problems",
]


def eos_id(tokenizer: TokenizerLike) -> int:
    """The end-of-sequence id (ends every model turn); a tokenizer without one is a ConfigError."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "tokenizer.eos_token_id=None: the tasks end every model turn with the end-of-sequence "
            "token; use a tokenizer that defines one"
        )
    return int(eos)


def encode_text(tokenizer: TokenizerLike, text: str) -> list[int]:
    """``text`` as token ids, without special tokens."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def encode_prompt(tokenizer: TokenizerLike, text: str) -> list[int]:
    """A prompt's token ids. With a chat template (a Hugging Face tokenizer's ``chat_template``):
    ``text`` as the user's message, rendered by the template with the generation prompt (the
    assistant's header) appended. Without one: the beginning-of-sequence token (if the tokenizer
    has one), then ``text``."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    bos = tokenizer.bos_token_id
    return ([int(bos)] if bos is not None else []) + encode_text(tokenizer, text)


def _render(tokenizer: TokenizerLike, messages: Sequence[Mapping[str, str]], prompt: bool) -> str:
    return str(
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": m["role"], "content": m["content"]} for m in messages],
            add_generation_prompt=prompt,
            tokenize=False,
        )
    )


def encode_chat(tokenizer: TokenizerLike, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Chat messages (``{"role", "content"}``) as the prompt of the next assistant turn: rendered
    by the tokenizer's chat template with the generation prompt appended. A tokenizer without a
    template takes a single user message as plain text (:func:`encode_prompt`); anything more is
    a ConfigError."""
    if getattr(tokenizer, "chat_template", None):
        # the template writes the special tokens itself (as text, which encodes to their ids)
        return encode_text(tokenizer, _render(tokenizer, messages, True))
    if len(messages) == 1 and messages[0]["role"] == "user":
        return encode_prompt(tokenizer, messages[0]["content"])
    roles = [m["role"] for m in messages]
    raise ConfigError(
        f"messages with roles {roles}: the tokenizer has no chat template to render a "
        "conversation with; use a checkpoint whose tokenizer has one (tokenizer_config.json's "
        "chat_template), or prompt with token ids"
    )


def encode_tool_reply(
    tokenizer: TokenizerLike, messages: Sequence[Mapping[str, str]], reply: str
) -> list[int]:
    """The token ids that put a tool's ``reply`` after the conversation ``messages`` — which end
    with the assistant turn that called the tool, as the model wrote it up to its stop token —
    and open the next assistant turn.

    With a chat template: what the template writes after that turn's end-of-sequence token for a
    ``{"role": "tool"}`` message and the generation prompt (the rendering of ``messages`` + the
    tool message, less the rendering of ``messages`` up to the end of the assistant's text and its
    end-of-sequence token). Without one (the built-in character tokenizer): ``reply`` as plain
    text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return encode_text(tokenizer, reply)
    said = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else None
    # where the assistant's text starts: after the generation prompt the model continued from
    header = _render(tokenizer, messages[:-1], True) if said is not None else ""
    before = _render(tokenizer, messages, False)
    after = _render(tokenizer, [*messages, {"role": "tool", "content": reply}], True)
    if said is None or not before.startswith(header + said) or not after.startswith(before):
        raise ConfigError(
            "tokenizer.chat_template: rendering the conversation with a tool reply added does "
            "not extend the rendering of the assistant turn before it, so the reply cannot be "
            "appended to the episode; use a template that renders each message on its own, and "
            "end messages with the assistant turn that called the tool"
        )
    cut = len(header) + len(said)
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and before.startswith(eos, cut):
        cut += len(eos)  # the model wrote its end of turn itself; what follows is the template's
    return encode_text(tokenizer, before[cut:] + after[len(before) :])


def stop_ids(tokenizer: TokenizerLike) -> tuple[int, ...]:
    """The ids generation stops on: the end-of-sequence token first (the one the tasks end a model
    turn with), then the checkpoint's other end-of-sequence ids (``tokenizer.stop_token_ids``,
    set by :func:`stalebound.engines.models.load_tokenizer` from the generation config)."""
    extra = getattr(tokenizer, "stop_token_ids", None) or ()
    return tuple(dict.fromkeys([eos_id(tokenizer), *(int(i) for i in extra)]))


def context_problems(
    task: EpisodeTask, tokenizer: TokenizerLike, samples: Sequence[Sample], max_positions: int
) -> list[str]:
    """A problem (``name=value: why; the fix``) if the longest rendered prompt plus
    ``task.max_new_tokens`` exceeds the model's ``max_positions``; empty if every first turn fits.

    Refusing up front (rather than truncating prompts) keeps what the model sees equal to what the
    task asked. Later turns of multi-turn episodes that reach the limit end with finish reason
    ``length`` and are truncated episodes, as any turn cut by ``max_new_tokens``.
    """
    longest, which = 0, ""
    for sample in samples:
        n = len(task.encode(tokenizer, sample))
        if n > longest:
            longest, which = n, sample.id
    new = task.config.max_new_tokens
    if longest + new <= max_positions:
        return []
    room = max_positions - longest
    fix = (
        f"lower task.max_new_tokens to {room} or less, or use a model with a longer context"
        if room > 0
        else "shorten the prompts, or use a model with a longer context"
    )
    return [
        f"task.max_new_tokens={new}: the longest prompt (sample {which!r}, {longest} tokens as "
        f"rendered) plus {new} new tokens exceeds the model's max_position_embeddings="
        f"{max_positions}; {fix}"
    ]


def vocabulary_problems(
    tokenizer: TokenizerLike, samples: Sequence[Sample], *, limit: int = 10_000
) -> list[str]:
    """A problem for the characters of the samples' questions and answers that the tokenizer
    encodes as its unknown token (the built-in character tokenizer knows printable ASCII and the
    newline; byte-level BPE tokenizers know every character). Checks the first ``limit``."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    seen: set[str] = set()
    bad: dict[str, str] = {}
    for sample in samples[:limit]:
        for ch in set(sample.question + sample.answer) - seen:
            seen.add(ch)
            if unk in tokenizer.encode(ch, add_special_tokens=False):
                bad.setdefault(ch, sample.id)
    if not bad:
        return []
    chars = sorted(bad)
    return [
        f"tokenizer: the characters {chars[:20]!r} (first in sample {bad[chars[0]]!r}) are not "
        "in the model's vocabulary and would be trained as the unknown token; use a model whose "
        "tokenizer covers the data (engine.model_path), or rewrite the data in the characters "
        "it knows"
    ]


def decode_text(tokenizer: TokenizerLike, ids: Sequence[int]) -> str:
    """Token ids as text, special tokens (such as the end-of-sequence token) dropped."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


async def await_reward(task: EpisodeTask, sample: Sample, metrics: dict[str, float]) -> None:
    """Wait for the reward of one answer as ``task.config.reward_latency`` says (a real sleep:
    the event loop runs other episodes meanwhile); with a latency configured, record the wait as
    ``metrics["reward_wait_s"]``."""
    delay = task.reward_delay(sample)
    if task.config.reward_latency.distribution != "none":
        metrics["reward_wait_s"] = delay
    if delay > 0:
        await asyncio.sleep(delay)


@dataclass(frozen=True)
class Generated:
    """One model turn as :meth:`EpisodeEngine.agenerate` answers it."""

    input_ids: tuple[int, ...]
    """The prompt as the model saw it (chat messages rendered and encoded)."""
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    output_versions: Sequence[int]
    finish_reason: str


class EpisodeEngine:
    """The engine as one episode's workflow sees it (a
    :class:`~stalebound.tasks.episode.WorkflowEngine`), over ``generate``, the function that runs
    one model turn on the run's engines. ``version()`` is the policy version now."""

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: TokenizerLike,
        task: EpisodeTask,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        self._generate = generate
        self.tokenizer = tokenizer
        self.task = task
        self._version = version
        self._stops: tuple[int, ...] | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids a turn stops on unless ``agenerate`` is given others (:func:`stop_ids`)."""
        if self._stops is None:
            self._stops = stop_ids(self.tokenizer)
        return self._stops

    def get_version(self) -> int:
        """The policy version the engine generates with now."""
        return self._version()

    def encode_row(self, row: Sample) -> list[int]:
        """The token ids of ``row``'s prompt as the task renders it (through the chat template
        when the row is a conversation, or the tokenizer has a template)."""
        return self.task.encode(self.tokenizer, row)

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: token ids as given, chat messages through :func:`encode_chat`."""
        if prompt and isinstance(prompt[0], Mapping):
            return encode_chat(self.tokenizer, prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    async def agenerate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Generated:
        """One model turn continuing ``prompt`` (see the module docstring)."""
        ids = self.encode(prompt)
        new = self.task.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        stops = self.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
        gen = await self._generate(ids, new, stops)
        return Generated(
            tuple(ids), gen.output_ids, gen.output_logprobs, gen.output_versions, gen.finish_reason
        )

    async def score(
        self, row: Sample, completion: str, *, truncated: bool = False
    ) -> dict[str, float]:
        """The run's reward of ``completion`` as the final answer to ``row``: metrics with
        ``score`` (the reward; 0 when ``truncated``)."""
        return await self.task.score(row, completion, truncated=truncated)


class _RunAdapter:
    """A workflow of the earlier interface, ``run(generate, sample)``, as a :class:`Workflow`."""

    def __init__(self, legacy: LegacyWorkflow) -> None:
        self.legacy = legacy

    async def arun_episode(self, engine: Any, row: Sample) -> Trajectory:
        async def generate(
            input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
        ) -> Generation:
            return await engine.agenerate(  # type: ignore[no-any-return]
                list(input_ids), max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
            )

        return await self.legacy.run(generate, row)

    def __repr__(self) -> str:
        return f"as_workflow({self.legacy!r})"


def as_workflow(workflow: Any) -> Workflow:
    """``workflow`` as a :class:`Workflow`: as it is when it has ``arun_episode``; one with only
    the earlier ``run(generate, sample)`` is adapted, with a DeprecationWarning."""
    if callable(getattr(workflow, "arun_episode", None)):
        return workflow  # type: ignore[no-any-return]
    if callable(getattr(workflow, "run", None)):
        warnings.warn(
            f"{type(workflow).__qualname__}.run(generate, sample) is deprecated and will be "
            "removed in the next release; define async arun_episode(self, engine, row) instead "
            "and generate with await engine.agenerate(input_ids, max_new_tokens=..., "
            "stop_token_ids=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _RunAdapter(workflow)
    raise ConfigError(
        f"workflow={workflow!r}: not a workflow; define async arun_episode(self, engine, row) "
        "returning a Trajectory"
    )


class SingleTurnWorkflow:
    """Prompt → one model turn → reward. The episode is truncated if the turn does not end with
    the stop token (length limit or abort), and then scores 0."""

    def __init__(self, task: EpisodeTask, tokenizer: TokenizerLike) -> None:
        self.task = task
        self.tokenizer = tokenizer
        # Every member of a group encodes the same prompt: keep the last few encodings.
        self._prompts: dict[str, list[int]] = {}

    def _encode_prompt(self, sample: Sample) -> list[int]:
        key = self.task.prompt(sample)
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) >= 4096:
                self._prompts.clear()
            ids = self._prompts[key] = self.task.encode(self.tokenizer, sample)
        return list(ids)

    async def arun_episode(self, engine: WorkflowEngine, row: Sample) -> Trajectory:
        sample = row
        prompt_ids = self._encode_prompt(sample)
        gen = await engine.agenerate(prompt_ids)
        truncated = gen.finish_reason != "stop"
        response = decode_text(self.tokenizer, gen.output_ids)
        metrics = await self.task.score(sample, response, truncated=truncated)
        return Trajectory(
            prompt_ids=prompt_ids,
            output_ids=list(gen.output_ids),
            behaviour_logprobs=[float(x) for x in gen.output_logprobs],
            versions=[int(v) for v in gen.output_versions],
            reward=metrics["score"],
            truncated=truncated,
            sample_id=sample.id,
            response=response,
            metrics=metrics,
        )

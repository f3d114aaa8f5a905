"""Episode runners that work over any engine.

A workflow turns one :class:`~stalebound.tasks.episode.Sample` into one
:class:`~stalebound.tasks.episode.Trajectory` by calling ``generate`` — an ``async`` function of
(prompt token ids, ``max_new_tokens``, stop token ids) that returns an object with ``output_ids``,
``output_logprobs``, ``output_versions`` and ``finish_reason`` (``stop`` | ``length`` | ``abort``).
The engines' ``GenerateResponse`` has exactly these fields, so adapting an engine is one line::

    async def generate(ids, max_new_tokens, stop_token_ids):
        return await engine.agenerate(GenerateRequest(rid, tuple(ids),
            SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))))

The stop token (end of turn) is part of ``output_ids`` and is trained on, so the policy learns when
to stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from stalebound.core.errors import ConfigError
from stalebound.tasks.episode import (
    EpisodeTask,
    GenerateFn,
    Generation,
    Sample,
    TokenizerLike,
    Trajectory,
    Workflow,
)

__all__ = [
    "GenerateFn",
    "Generation",
    "SingleTurnWorkflow",
    "TokenizerLike",
    "Workflow",
    "await_reward",
    "context_problems",
    "decode_text",
    "encode_prompt",
    "encode_text",
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
        rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        # The template writes the special tokens itself (as text, which encodes to their ids).
        return encode_text(tokenizer, str(rendered))
    bos = tokenizer.bos_token_id
    return ([int(bos)] if bos is not None else []) + encode_text(tokenizer, text)


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


class SingleTurnWorkflow:
    """Prompt → one model turn → reward. The episode is truncated if the turn does not end with
    the stop token (length limit or abort), and then scores 0."""

    def __init__(self, task: EpisodeTask, tokenizer: TokenizerLike) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.stops = stop_ids(tokenizer)
        # Every member of a group encodes the same prompt: keep the last few encodings.
        self._prompts: dict[str, list[int]] = {}

    def _encode_prompt(self, sample: Sample) -> list[int]:
        text = self.task.prompt(sample)
        ids = self._prompts.get(text)
        if ids is None:
            if len(self._prompts) >= 4096:
                self._prompts.clear()
            ids = self._prompts[text] = encode_prompt(self.tokenizer, text)
        return list(ids)

    async def run(self, generate: GenerateFn, sample: Sample) -> Trajectory:
        prompt_ids = self._encode_prompt(sample)
        gen = await generate(prompt_ids, self.task.config.max_new_tokens, self.stops)
        truncated = gen.finish_reason != "stop"
        response = decode_text(self.tokenizer, gen.output_ids)
        metrics = self.task.metrics(sample, response, truncated=truncated)
        await await_reward(self.task, sample, metrics)
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

"""The default policy model, built locally, and loading of any local Hugging Face checkpoint.

:func:`build_default_model` creates the embedded default policy from scratch — nothing is downloaded:
a tiny ``LlamaForCausalLM`` (hidden size 128, 2 layers, about 0.36 M parameters) created from a
config with seeded random weights, and a character-level ``PreTrainedTokenizerFast`` (a ``tokenizers``
WordLevel model over a fixed character set). Both are written with ``save_pretrained`` into a
directory the caller chooses, which then is an ordinary Hugging Face checkpoint directory:
:func:`load_model` and :func:`load_tokenizer` read it, or any other local checkpoint directory
(a user's Qwen, Llama or Mistral checkpoint): the tokenizer's chat template renders the prompts,
the generation config's end-of-sequence ids stop generation, and :func:`checkpoint_info` gives the
context length the job checks prompts against (see docs/models.md).

:func:`build_bpe_model` builds a checkpoint shaped like a user's — a tiny ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` with a byte-level BPE tokenizer trained locally on the built-in tasks' text, a
chat template and a generation config — so that path is exercised without a download.

The character set covers what the built-in tasks need (multi-digit arithmetic, string
manipulation): the digits, the ASCII letters, ASCII punctuation, space and newline. Any other
character encodes as ``<unk>``. Encoding prepends ``<bos>``; decoding concatenates characters.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from stalebound.core.errors import ConfigError
from stalebound.engines.devices import resolve_device, torch_dtype
from stalebound.tasks.corpus import task_corpus
from stalebound.userfiles import label

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "BPE_ARCHS",
    "CHARSET",
    "CHATML_TEMPLATE",
    "DEFAULT_MODEL_CONFIG",
    "LLAMA_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "CheckpointInfo",
    "build_bpe_model",
    "build_bpe_tokenizer",
    "build_default_model",
    "build_default_tokenizer",
    "cache_keyword",
    "checkpoint_info",
    "checkpoint_problem",
    "is_default_model",
    "load_model",
    "load_tokenizer",
]

_log = logging.getLogger(__name__)

SPECIAL_TOKENS: Final[tuple[str, ...]] = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Special tokens, in id order: pad = 0, bos = 1, eos = 2, unk = 3."""

CHARSET: Final[str] = string.digits + string.ascii_letters + string.punctuation + " \n"
"""The characters the default tokenizer knows; their ids follow the special tokens, in this order."""

DEFAULT_MODEL_CONFIG: Final[dict[str, Any]] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
"""``LlamaConfig`` fields of the default policy (the vocabulary size and token ids are added)."""

# Written beside the checkpoint so a later call with the same seed reuses it instead of rebuilding.
_MARKER: Final[str] = "stalebound_default_model.json"
_MARKER_FORMAT: Final[int] = 1


def _built(marker: Path, wanted: dict[str, Any]) -> bool:
    """Whether the checkpoint beside ``marker`` was built with exactly ``wanted`` (reuse it)."""
    try:
        return bool(marker.is_file() and json.loads(marker.read_text()) == wanted)
    except (OSError, ValueError):
        return False  # a damaged marker: rebuild


def build_default_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer of the default model (not saved anywhere)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARSET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character (newline included) is its own piece; decoding glues pieces back together.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_default_model(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Create the default policy and its tokenizer in the checkpoint directory ``path``.

    Idempotent: if ``path`` already holds the default model built with the same ``seed``, it is
    reused as is (so callers may pass a cache directory). Otherwise the directory is created (or
    overwritten file by file) with ``config.json``, the weights and the tokenizer files. The same
    seed always gives the same weights. Returns ``path`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(path)
    wanted = {"format": _MARKER_FORMAT, "seed": int(seed), "config": DEFAULT_MODEL_CONFIG}
    if is_default_model(target, seed=seed):
        return target  # (a damaged or different marker: rebuilt below)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_default_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **DEFAULT_MODEL_CONFIG,
    )
    # Seed a private generator state so building a model does not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / _MARKER).write_text(json.dumps(wanted, sort_keys=True))
    _log.info("built the default model (seed %d) in %s", seed, target)
    return target


BPE_ARCHS: Final[tuple[str, ...]] = ("qwen2", "llama")
"""Architectures :func:`build_bpe_model` builds."""

CHATML_TEMPLATE: Final[str] = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML chat template (Qwen's): ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""

LLAMA_CHAT_TEMPLATE: Final[str] = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
"""A Llama-2-style chat template: ``<s>[INST] prompt [/INST]answer</s>``."""

_BPE_MARKER: Final[str] = "stalebound_bpe_model.json"
_BPE_SPECIALS: Final[dict[str, tuple[str, ...]]] = {
    # in id order; the first is padding
    "qwen2": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "llama": ("<pad>", "<s>", "</s>"),
}


def build_bpe_tokenizer(
    arch: str = "qwen2", *, vocab_size: int = 384, chat_template: bool = True
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the built-in tasks' text (not saved anywhere).

    ``qwen2``: special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of
    turn), no beginning-of-sequence token, a ChatML template. ``llama``: ``<pad>``, ``<s>``,
    ``</s>`` and a Llama-2-style template. ``chat_template=False`` leaves the template out (plain
    prompts).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if arch not in BPE_ARCHS:
        raise ConfigError(f"arch={arch!r}: not a BPE model architecture; use one of {BPE_ARCHS}")
    specials = _BPE_SPECIALS[arch]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(task_corpus(), trainer=trainer)
    if arch == "qwen2":
        names = {"pad_token": specials[0], "eos_token": specials[2]}
        template = CHATML_TEMPLATE
    else:
        names = {"pad_token": specials[0], "bos_token": specials[1], "eos_token": specials[2]}
        template = LLAMA_CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)  # type: ignore[no-untyped-call]
    if arch == "qwen2":
        fast.add_special_tokens({"additional_special_tokens": [specials[1]]})
    if chat_template:
        fast.chat_template = template
    return fast


def build_bpe_model(
    path: str | os.PathLike[str],
    arch: str = "qwen2",
    *,
    seed: int = 0,
    vocab_size: int = 384,
    chat_template: bool = True,
    max_position_embeddings: int = 256,
) -> Path:
    """Create a tiny ``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` with a byte-level BPE tokenizer
    (see :func:`build_bpe_tokenizer`) in the checkpoint directory ``path``, as a user's checkpoint
    would be: ``config.json``, ``generation_config.json`` (end-of-sequence ids: a list for
    ``qwen2``, as Qwen's), weights and tokenizer files with the chat template.

    The model has the default model's size (hidden 128, 2 layers) with seeded random weights.
    Idempotent like :func:`build_default_model` (same arguments: reused). Returns ``path``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    target = Path(path)
    marker = target / _BPE_MARKER
    wanted = {
        "format": _MARKER_FORMAT,
        "arch": arch,
        "seed": int(seed),
        "vocab_size": vocab_size,
        "chat_template": chat_template,
        "max_position_embeddings": max_position_embeddings,
    }
    if _built(marker, wanted):
        return target
    tokenizer = build_bpe_tokenizer(arch, vocab_size=vocab_size, chat_template=chat_template)
    sizes = {**DEFAULT_MODEL_CONFIG, "max_position_embeddings": max_position_embeddings}
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "qwen2":
            sizes["num_key_value_heads"] = 2  # grouped-query attention, as Qwen2 uses
            model: Any = Qwen2ForCausalLM(Qwen2Config(**ids, **sizes))
        else:
            model = LlamaForCausalLM(LlamaConfig(**ids, **sizes))
    if arch == "qwen2":  # Qwen's instruct models stop on end-of-turn and end-of-text
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    marker.write_text(json.dumps(wanted, sort_keys=True))
    _log.info("built a tiny %s BPE model (seed %d) in %s", arch, seed, target)
    return target


def is_default_model(path: str | os.PathLike[str], *, seed: int = 0) -> bool:
    """Whether ``path`` already holds the default model built with ``seed`` (then
    :func:`build_default_model` reuses it and writes nothing)."""
    wanted = {"format": _MARKER_FORMAT, "seed": int(seed), "config": DEFAULT_MODEL_CONFIG}
    return _built(Path(path) / _MARKER, wanted)


_NOT_A_CHECKPOINT_FIX = (
    "pass a directory written by save_pretrained, or create the default model with "
    "stalebound.engines.models.build_default_model(path)"
)


def checkpoint_problem(path: str | os.PathLike[str], name: str = "model path") -> str | None:
    """Why ``path`` is not a local Hugging Face checkpoint directory (no readable ``config.json``
    holding a JSON object), as ``name=path: why; the fix`` — or ``None``. Reads one small file."""
    head = label(name, path)
    config = Path(path) / "config.json"
    try:
        with open(config, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return f"{head}: not a Hugging Face checkpoint directory (no config.json); {_NOT_A_CHECKPOINT_FIX}"
    except OSError as exc:
        return (
            f"{head}: cannot read its config.json ({exc.strerror or exc}); {_NOT_A_CHECKPOINT_FIX}"
        )
    try:
        data = json.loads(raw)
    except ValueError as exc:  # not UTF-8, or not JSON
        return (
            f"{head}: its config.json is not valid JSON ({str(exc).split(':')[0]}); "
            f"{_NOT_A_CHECKPOINT_FIX}"
        )
    if not isinstance(data, dict):
        return f"{head}: its config.json holds no JSON object; {_NOT_A_CHECKPOINT_FIX}"
    return None


def _unloadable(path: str | os.PathLike[str], exc: BaseException) -> str:
    why = " ".join(str(exc).split())[:300]
    return f"model path={str(path)!r}: cannot load it ({why}); {_NOT_A_CHECKPOINT_FIX}"


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    return Path(path)


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
) -> PreTrainedModel:
    """Load the causal LM in the local checkpoint directory ``path`` (never downloads), in eval mode.

    ``dtype`` (a ``torch.dtype`` or ``float32`` / ``bfloat16`` / ``float16``) defaults to float32,
    the precision the engine's log-probabilities are specified in. ``device`` (``auto``, ``cpu``,
    ``cuda``, ``cuda:N``; default the CPU) is where the weights are placed.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            _checkpoint_dir(path),
            dtype=dtype or torch.float32,
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # what transformers raises
        raise ConfigError(_unloadable(path, exc)) from exc
    if device is not None and resolve_device(device) != "cpu":
        placed: Any = model  # transformers types .to() for its own wrapper, not a device name
        placed.to(resolve_device(device))
    model.eval()  # type: ignore[no-untyped-call]
    return model


@dataclass(frozen=True)
class CheckpointInfo:
    """What the job needs to know about a checkpoint before loading its weights."""

    max_positions: int
    """``max_position_embeddings``: prompt + generated tokens may not exceed it."""
    stop_ids: tuple[int, ...]
    """End-of-sequence ids of the generation config (and of the model config), in order."""
    vocab_size: int


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache under (and its output returns it as).

    transformers 5.2x calls it ``cache``; releases from 4.54 up to then, ``past_key_values``.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def id_tuple(value: Any) -> tuple[int, ...]:
    """A config's token id field (``None``, one id or a list of ids) as a tuple of ids."""
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def checkpoint_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Read ``config.json`` and ``generation_config.json`` (if any) of a checkpoint directory."""
    target = _checkpoint_dir(path)
    config = json.loads((target / "config.json").read_text())
    # multimodal and newer configs nest the text model's settings
    text = config.get("text_config") or config
    stops = id_tuple(text.get("eos_token_id"))
    generation = target / "generation_config.json"
    if generation.is_file():
        try:
            stops = id_tuple(json.loads(generation.read_text()).get("eos_token_id")) + stops
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"{label('model path', target)}: its generation_config.json does not give "
                f"end-of-sequence ids ({type(exc).__name__}: {exc}); fix eos_token_id there (an "
                "id or a list of ids), or remove the file"
            ) from None
    return CheckpointInfo(
        max_positions=int(text.get("max_position_embeddings") or 1 << 30),
        stop_ids=tuple(dict.fromkeys(stops)),
        vocab_size=int(text.get("vocab_size") or 0),
    )


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved in the local checkpoint directory ``path`` (never downloads).

    Its ``stop_token_ids`` attribute is set to the checkpoint's end-of-sequence ids (see
    :func:`checkpoint_info`), which the workflows stop generation on; its chat template, if it
    has one, renders the prompts (:func:`stalebound.tasks.workflow.encode_prompt`).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(_checkpoint_dir(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # what transformers raises
        raise ConfigError(_unloadable(path, exc)) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"model path={str(path)!r}: its tokenizer is not a fast (tokenizers) tokenizer; "
            "save a PreTrainedTokenizerFast with the checkpoint"
        )
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"model path={str(path)!r}: its tokenizer has no eos_token; the tasks end every model "
            "turn with it: set eos_token (the end-of-turn token, e.g. <|im_end|>) in "
            "tokenizer_config.json"
        )
    tokenizer.stop_token_ids = checkpoint_info(path).stop_ids
    fast: PreTrainedTokenizerFast = tokenizer
    return fast

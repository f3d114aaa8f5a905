"""The default policy model, built locally, and loading of any local Hugging Face checkpoint.

:func:`build_default_model` creates the embedded default policy from scratch — nothing is downloaded:
a tiny ``LlamaForCausalLM`` (hidden size 128, 2 layers, about 0.36 M parameters) created from a
config with seeded random weights, and a character-level ``PreTrainedTokenizerFast`` (a ``tokenizers``
WordLevel model over a fixed character set). Both are written with ``save_pretrained`` into a
directory the caller chooses, which then is an ordinary Hugging Face checkpoint directory:
:func:`load_model` and :func:`load_tokenizer` read it, or any other local checkpoint directory.

The character set covers what the built-in tasks need (multi-digit arithmetic, string
manipulation): the digits, the ASCII letters, ASCII punctuation, space and newline. Any other
character encodes as ``<unk>``. Encoding prepends ``<bos>``; decoding concatenates characters.
"""

from __future__ import annotations

import json
import logging
import os
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from stalebound.core.errors import ConfigError
from stalebound.userfiles import label

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "CHARSET",
    "DEFAULT_MODEL_CONFIG",
    "SPECIAL_TOKENS",
    "build_default_model",
    "build_default_tokenizer",
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
    marker = target / _MARKER
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
    marker.write_text(json.dumps(wanted, sort_keys=True))
    _log.info("built the default model (seed %d) in %s", seed, target)
    return target


def is_default_model(path: str | os.PathLike[str], *, seed: int = 0) -> bool:
    """Whether ``path`` already holds the default model built with ``seed`` (then
    :func:`build_default_model` reuses it and writes nothing)."""
    wanted = {"format": _MARKER_FORMAT, "seed": int(seed), "config": DEFAULT_MODEL_CONFIG}
    try:
        return bool(json.loads((Path(path) / _MARKER).read_text()) == wanted)
    except (OSError, ValueError):
        return False


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
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load the causal LM in the local checkpoint directory ``path`` (never downloads), in eval mode.

    ``dtype`` defaults to float32, the precision the engine's log-probabilities are specified in.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            _checkpoint_dir(path),
            dtype=dtype or torch.float32,
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # what transformers raises
        raise ConfigError(_unloadable(path, exc)) from exc
    model.eval()  # type: ignore[no-untyped-call]
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved in the local checkpoint directory ``path`` (never downloads)."""
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
    fast: PreTrainedTokenizerFast = tokenizer
    return fast

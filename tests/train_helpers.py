"""Test helpers for the task and training tests: a character tokenizer, a tiny Llama, and what
someone crafting a checkpoint does (re-sign its manifest, plant a pickle that runs code)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stalebound.tasks.charset import CHARSET

PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
    """One token per character of CHARSET (ids from 3), plus <pad>=0, <bos>=1, <eos>=2."""

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS

    def __init__(self) -> None:
        self.ids = {c: i + 3 for i, c in enumerate(CHARSET)}
        self.chars = {i: c for c, i in self.ids.items()}
        self.vocab_size = len(CHARSET) + 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.ids[c] for c in text]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        special = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}
        return "".join(
            self.chars[t] if t in self.chars else ("" if skip_special_tokens else special[t])
            for t in token_ids
        )


def tiny_llama(vocab_size: int = 64, hidden: int = 64, layers: int = 2, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def resign(checkpoint: Path) -> None:
    """Fix up a checkpoint's manifest after its files were changed: every size and digest."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for rel, meta in manifest["files"].items():
        data = (checkpoint / rel).read_bytes()
        meta.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class CodeOnUnpickle:
    """Unpickling it runs a shell command, which leaves ``marker`` behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))

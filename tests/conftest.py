"""Session-wide fixtures: user-style checkpoints (byte-level BPE tokenizers with chat templates),
built locally once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


def _build(
    factory: pytest.TempPathFactory, name: str, arch: str, *, chat_template: bool = True
) -> Path:
    pytest.importorskip("torch")
    from stalebound.engines.models import build_bpe_model

    path = factory.getbasetemp() / "bpe-models" / name
    return build_bpe_model(path, arch, chat_template=chat_template)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2ForCausalLM with a BPE tokenizer and a ChatML template (stops on a list)."""
    return _build(tmp_path_factory, "qwen2", "qwen2")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForCausalLM with a BPE tokenizer and a Llama-2-style template."""
    return _build(tmp_path_factory, "llama", "llama")


@pytest.fixture(scope="session")
def plain_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a BPE tokenizer and no chat template (plain-text prompts)."""
    return _build(tmp_path_factory, "llama-plain", "llama", chat_template=False)

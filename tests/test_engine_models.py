"""The default model and tokenizer, and the worker's sampler (in-process, no worker)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.engines._worker import sample, uniform  # noqa: E402
from stalebound.engines.models import (  # noqa: E402
    CHARSET,
    build_default_model,
    load_model,
    load_tokenizer,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.getbasetemp() / "default-model", seed=0)


def test_default_model_is_a_tiny_llama_saved_locally(model_dir: Path) -> None:
    model = load_model(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(load_tokenizer(model_dir))
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 400_000
    assert not model.training


def test_build_is_deterministic_and_reuses_the_cache(model_dir: Path, tmp_path: Path) -> None:
    weights = next(model_dir.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    assert build_default_model(model_dir, seed=0) == model_dir
    assert weights.stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = load_model(build_default_model(tmp_path / "same-seed", seed=0))
    base = load_model(model_dir)
    for (name, a), (_, b) in zip(
        base.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tokenizer_round_trips_arithmetic_and_text(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    text = "12345 * 678 = ?\nReverse 'Hello, World!' -> (x_y)"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(CHARSET).input_ids, skip_special_tokens=True) == CHARSET
    assert tok.eos_token_id == load_model(model_dir).config.eos_token_id


def test_load_model_refuses_a_directory_without_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="build_default_model"):
        load_model(tmp_path)


def test_uniform_is_a_pure_function_of_seed_and_index() -> None:
    values = [uniform(3, i) for i in range(2000)]
    assert values == [uniform(3, i) for i in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert uniform(3, 0) != uniform(4, 0)


def test_sampler_greedy_rows_and_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens, logprobs = sample(
        logits,
        torch.tensor([0.0, 0.0]),
        torch.tensor([1.0, 1.0]),
        torch.zeros(2, dtype=torch.float64),
    )
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, expected)


def test_sampler_follows_the_tempered_top_p_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    us = torch.tensor([uniform(9, i) for i in range(n)], dtype=torch.float64)
    batch = logits.repeat(n, 1)
    # top_p = 0.75: keeps {0, 1} (mass before token 1 is 0.5 < 0.75; before token 2 it is 0.8).
    tokens, logprobs = sample(batch, torch.ones(n), torch.full((n,), 0.75), us)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / n - 0.5 / 0.8) < 0.03
    # The log-probs stay those of the raw distribution, not of the truncated one.
    assert logprobs[tokens == 1][0].item() == pytest.approx(math.log(0.3), abs=1e-6)
    # Temperature 2 flattens: token 3 becomes likelier than at temperature 1.
    tokens_hot, _ = sample(batch, torch.full((n,), 2.0), torch.ones(n), us)
    tokens_one, _ = sample(batch, torch.ones(n), torch.ones(n), us)
    assert (tokens_hot == 3).sum() > (tokens_one == 3).sum()

"""Low-rank adapters (``train.lora``): only the adapters train, the engines get merged weights, a
checkpoint holds the adapter and a resumed run continues from it exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from parallel_helpers import PAD, make_batch, same_step  # noqa: E402
from stalebound.config import load_config  # noqa: E402
from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.engines.models import build_default_model, load_model  # noqa: E402
from stalebound.train import TrainConfig, Trainer  # noqa: E402
from stalebound.train.config import LoraConfig  # noqa: E402

torch.set_num_threads(1)

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("lora-model"), seed=0)


def lora_trainer(model_dir: Path, version: int = 0, checkpointing: bool = False) -> Trainer:
    config = TrainConfig(
        lr=1e-2,
        num_threads=1,
        lora=LoraConfig(rank=4, alpha=8),
        gradient_checkpointing=checkpointing,
    )
    return Trainer(load_model(model_dir), None, config, pad_token_id=PAD, version=version)


def test_adapters_train_alike_with_activations_recomputed(model_dir: Path) -> None:
    """``train.gradient_checkpointing`` with LoRA (the base frozen, its embeddings too): the
    blocks recomputed in the backward pass give the adapters the gradients they get without."""
    torch.manual_seed(0)  # the adapters' A matrices start random: alike in both
    plain = lora_trainer(model_dir)
    torch.manual_seed(0)
    recomputed = lora_trainer(model_dir, checkpointing=True)
    batch = make_batch(load_model(model_dir), groups=4, size=3, seed=0, shift=0.3)
    same_step(plain.step(batch, batch_version=1), recomputed.step(batch, batch_version=1))
    want, got = plain.state_dict_for_engines(), recomputed.state_dict_for_engines()
    base = load_model(model_dir).state_dict()
    assert any(not torch.equal(got[k], base[k]) for k in got)  # the adapters did move
    for k in want:
        assert torch.allclose(want[k], got[k], atol=1e-6), k


def test_only_the_adapters_train_and_the_engines_get_the_merged_weights(model_dir: Path) -> None:
    base = load_model(model_dir)
    trainer = lora_trainer(model_dir)
    trained = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    # rank 4 on the four attention projections of every layer: A (4 × in) and B (out × 4)
    layers = base.config.num_hidden_layers
    hidden = base.config.hidden_size
    kv = base.config.num_key_value_heads * (hidden // base.config.num_attention_heads)
    per_layer = 4 * (hidden + hidden) + 2 * 4 * (hidden + kv) + 4 * (hidden + hidden)
    assert sum(p.numel() for p in trained) == layers * per_layer
    trainer.step(make_batch(base, groups=4, size=3, seed=0, shift=0.3), batch_version=1)

    merged = trainer.state_dict_for_engines()
    before = base.state_dict()
    assert set(merged) == set(before)  # the plain model's names: an engine loads them as they are
    changed = {k for k in merged if not torch.equal(merged[k], before[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in ADAPTED for k in changed), changed

    served = load_model(model_dir)
    served.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        got, want = served(input_ids=ids).logits, trainer.model(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5


def test_a_checkpoint_holds_the_adapter_and_the_next_step_is_the_same(
    model_dir: Path, tmp_path: Path
) -> None:
    base = load_model(model_dir)
    batches = [make_batch(base, groups=4, size=3, seed=s, shift=0.3) for s in range(2)]
    trainer = lora_trainer(model_dir)
    trainer.step(batches[0], batch_version=1)
    trainer.save_optimizer(tmp_path)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    again = lora_trainer(model_dir, version=1)  # the base policy again, then the adapter
    again.load_optimizer(tmp_path, trainer.optimizer_state())
    same_step(trainer.step(batches[1], batch_version=2), again.step(batches[1], batch_version=2))
    a, b = trainer.state_dict_for_engines(), again.state_dict_for_engines()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0

    plain = Trainer(load_model(model_dir), None, TrainConfig(num_threads=1), pad_token_id=PAD)
    plain.step(batches[0], batch_version=1)
    plain.save_optimizer(tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"holds no adapter .* resume it with train.lora.rank=0"):
        lora_trainer(model_dir, version=1).load_optimizer(tmp_path / "plain", None)


def test_bad_adapter_settings_name_the_value_and_the_fix(model_dir: Path) -> None:
    config = TrainConfig(num_threads=1, lora=LoraConfig(rank=4, target_modules=["c_attn"]))
    with pytest.raises(ConfigError) as info:
        Trainer(load_model(model_dir), None, config, pad_token_id=PAD)
    assert str(info.value).startswith(
        "train.lora.target_modules=['c_attn']: the model has no layer named c_attn; its linear "
        "layers are "
    ), info.value
    assert "q_proj" in str(info.value)
    with pytest.raises(ConfigError, match=r"train.lora.target_modules=\[\]: adapters need"):
        TrainConfig(lora=LoraConfig(rank=4, target_modules=[])).validate()
    with pytest.raises(ConfigError, match=r"train.lora.rank=-1: "):
        load_config(overrides=["train.lora.rank=-1"])

    from stalebound.train.parallel.settings import parallel_problems

    assert parallel_problems(
        load_config(overrides=["train.lora.rank=8", "train.world_size=2"])
    ) == [
        "train.lora.rank=8: adapters are trained by one trainer in the job's process, not by "
        "trainer ranks; set train.world_size=1, train.parallel=ddp and backend=local, or "
        "train.lora.rank=0"
    ]


@pytest.mark.slow
def test_stalebound_train_with_adapters_learns_checkpoints_them_and_resumes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from peft import PeftModel

    from stalebound.cli import main
    from stalebound.train.ledger import audit_run
    from stalebound.train.lora import merged_state_dict

    run = tmp_path_factory.mktemp("lora-run") / "r"
    common = ["run.live=false", "run.plots=false", "run.checkpoint_every_steps=10"]
    args = [
        "train",
        "train.lora.rank=16",
        "train.lr=3e-3",
        "run.steps=10",
        f"run.run_dir={run}",
        "run.eval_prompts=200",
        f"engine.cache_dir={tmp_path_factory.mktemp('models')}",
        *common,
    ]
    assert main(args) == 0
    assert main(["train", f"resume={run}", "run.steps=20", *common]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # greedy accuracy on 200 held-out prompts (seed 0: 0.37 before; 30 steps reach 0.56)
    assert summary["eval_after"] >= summary["eval_before"] + 0.05, summary
    assert summary["violations"] == 0
    assert audit_run(run).ok
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))

    # the checkpoint: the merged policy, a plain model any engine serves, and the adapter
    checkpoint = run / "checkpoints" / "step-000020"
    served: Any = load_model(checkpoint)
    adapted = PeftModel.from_pretrained(load_model(run / "policy-v0"), checkpoint / "adapter")
    expected = merged_state_dict(adapted)
    got = served.state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in expected.items()) <= 1e-6

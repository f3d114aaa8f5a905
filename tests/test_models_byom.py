"""Bring your own checkpoint: user-style Qwen2 and Llama checkpoints (byte-level BPE tokenizers
trained here, chat templates, end-of-sequence lists) loaded through the user's path; device and
precision settings; micro-batches."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stalebound.cli import main  # noqa: E402
from stalebound.config import load_config  # noqa: E402
from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.engines import GenerateRequest, LocalEngine, SamplingParams  # noqa: E402
from stalebound.engines.devices import device_problems, resolve_device  # noqa: E402
from stalebound.engines.models import checkpoint_info, load_model, load_tokenizer  # noqa: E402
from stalebound.tasks import TaskConfig, Trajectory, make_task  # noqa: E402
from stalebound.tasks.workflow import context_problems, encode_prompt, stop_ids  # noqa: E402
from stalebound.train import TrainConfig, Trainer, evaluate, warm_start  # noqa: E402
from stalebound.train.warmstart import demonstration_tokens  # noqa: E402

torch.set_num_threads(1)

NO_GPU = "torch.cuda.is_available() is False"


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU machine's answer, also on a machine with a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- the checkpoints ------------------------------------------------------------------------------


def test_bpe_checkpoints_look_like_a_users(qwen2_dir: Path, llama_dir: Path) -> None:
    text = "37*24+15? reverse hello"
    for path, arch in ((qwen2_dir, "Qwen2ForCausalLM"), (llama_dir, "LlamaForCausalLM")):
        model, tok = load_model(path), load_tokenizer(path)
        assert type(model).__name__ == arch
        backend = tok.backend_tokenizer
        assert type(backend.model).__name__ == "BPE"
        # (transformers may wrap it in the architecture's own split rules, as for Qwen2)
        assert "ByteLevel" in repr(backend.pre_tokenizer)
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) < len(text), "subword merges: fewer tokens than characters"
        assert tok.decode(ids) == text
        assert tok.chat_template
        assert model.config.vocab_size == len(tok)
    qwen = load_tokenizer(qwen2_dir)
    im_end, eot = qwen.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # Qwen's generation config stops on a list: end of turn, then end of text
    assert json.loads((qwen2_dir / "generation_config.json").read_text())["eos_token_id"] == [
        im_end,
        eot,
    ]
    assert checkpoint_info(qwen2_dir).stop_ids == (im_end, eot)
    assert checkpoint_info(qwen2_dir).max_positions == 256
    assert qwen.eos_token == "<|im_end|>" and qwen.bos_token is None
    assert stop_ids(qwen) == (im_end, eot)


def test_prompts_render_with_the_chat_template_or_as_plain_text(
    qwen2_dir: Path, llama_dir: Path, plain_bpe_dir: Path
) -> None:
    qwen = load_tokenizer(qwen2_dir)
    ids = encode_prompt(qwen, "3+4=")
    assert qwen.decode(ids) == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == qwen.convert_tokens_to_ids("<|im_start|>")  # a special token, not its text
    llama = load_tokenizer(llama_dir)
    ids = encode_prompt(llama, "3+4=")
    assert ids[0] == llama.bos_token_id
    assert llama.decode(ids) == "<s>[INST] 3+4= [/INST]"
    plain = load_tokenizer(plain_bpe_dir)
    assert not plain.chat_template
    assert encode_prompt(plain, "3+4=") == [
        plain.bos_token_id,
        *plain.encode("3+4=", add_special_tokens=False),
    ]


def test_warm_start_trains_the_answer_and_end_of_turn_only(qwen2_dir: Path) -> None:
    tok = load_tokenizer(qwen2_dir)
    task = make_task(TaskConfig(name="calculator"))
    sample = task.samples()[0]
    ids, mask = demonstration_tokens(tok, task, sample)
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    model_turns = [t.text for t in task.demonstration(sample) if t.role == "model"]
    assert tok.decode(trained) == "".join(f"{text}<|im_end|>" for text in model_turns)
    template = {tok.convert_tokens_to_ids("<|im_start|>"), tok.pad_token_id}
    assert template & set(ids)  # the template's special tokens are there ...
    assert not any(m for t, m in zip(ids, mask, strict=True) if t in template)  # ... never trained


def test_warm_start_teaches_the_bpe_model_to_answer_and_stop(qwen2_dir: Path) -> None:
    model, tok = load_model(qwen2_dir), load_tokenizer(qwen2_dir)
    task = make_task(TaskConfig())
    samples = task.samples()[:24]
    before = evaluate(model, tok, task, samples)
    ws = warm_start(model, tok, task, 40, batch_size=32, seed=0)
    after = evaluate(model, tok, task, samples)
    assert ws.last_loss < 0.25 * ws.first_loss, ws
    assert before["response_length"] == task.config.max_new_tokens  # random weights ramble
    assert after["response_length"] < 4  # an answer of one or two tokens and <|im_end|>
    assert after["acc"] > before["acc"]


def test_too_long_a_prompt_is_refused_with_the_numbers(qwen2_dir: Path) -> None:
    tok = load_tokenizer(qwen2_dir)
    task = make_task(TaskConfig(max_new_tokens=250))
    samples = task.samples()
    longest = max(len(encode_prompt(tok, task.prompt(s))) for s in samples)
    (problem,) = context_problems(task, tok, samples, 256)
    assert problem.startswith("task.max_new_tokens=250: the longest prompt (sample ")
    assert (
        f"{longest} tokens as rendered) plus 250 new tokens exceeds the model's "
        f"max_position_embeddings=256; lower task.max_new_tokens to {256 - longest} or less"
    ) in problem
    assert context_problems(task, tok, samples, longest + 250) == []


def test_train_refuses_a_context_overflow_before_the_run_directory_is_made(
    qwen2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "never"
    args = [
        "train",
        f"engine.model_path={qwen2_dir}",
        "task.max_new_tokens=255",
        f"run.run_dir={run_dir}",
        "run.live=false",
    ]
    assert main(args) == 2
    assert "exceeds the model's max_position_embeddings=256" in capsys.readouterr().err
    assert not run_dir.exists()


# -- the engine -----------------------------------------------------------------------------------


def test_local_engine_stops_on_every_end_of_sequence_id_of_the_generation_config(
    qwen2_dir: Path,
) -> None:
    tok = load_tokenizer(qwen2_dir)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    prompt = tuple(encode_prompt(tok, "3+4="))
    state = load_model(qwen2_dir).state_dict()
    # All-zero logits: greedy takes id 0, <|endoftext|> — a stop id of the generation config only
    # (config.json's eos_token_id is <|im_end|>).
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    assert json.loads((qwen2_dir / "config.json").read_text())["eos_token_id"] == im_end
    assert eot == 0

    async def scenario() -> None:
        async with LocalEngine(qwen2_dir) as engine:
            info = await engine._info()
            assert set(info.eos_ids) == {im_end, eot} and info.device == "cpu"
            await engine.update_weights(state, 1)
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
            response = await engine.agenerate(GenerateRequest("r", prompt, greedy))
            assert response.output_ids == (eot,) and response.finish_reason == "stop"
            assert response.output_versions == (1,)

    asyncio.run(scenario())


def test_local_engine_takes_a_dtype_and_refuses_bad_device_settings(
    qwen2_dir: Path, no_gpu: None
) -> None:
    tok = load_tokenizer(qwen2_dir)
    prompt = tuple(encode_prompt(tok, "3+4="))

    async def scenario() -> None:
        async with LocalEngine(qwen2_dir, dtype="bfloat16") as engine:
            response = await engine.agenerate(
                GenerateRequest("r", prompt, SamplingParams(max_new_tokens=4, seed=1))
            )
            assert len(response.output_logprobs) == response.num_output_tokens > 0

    asyncio.run(scenario())
    with pytest.raises(ConfigError) as err:
        LocalEngine(qwen2_dir, device="cuda", dtype="float8")
    assert sorted(err.value.problems) == [
        f"engine.device=cuda: no CUDA GPU is available here ({NO_GPU}); use engine.device=cpu, "
        "or auto to take a GPU when there is one",
        "engine.dtype=float8: not a supported precision; use one of float32, bfloat16, float16",
    ]


# -- device and precision settings -------------------------------------------------------------------


def test_device_settings_fail_at_load_time_with_the_fix(no_gpu: None) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                "train.device=cuda",
                "engine.device=gpu",
                "train.micro_batch_tokens=0",
                "rollout.group_size=0",
            ]
        )
    problems = str(err.value)
    assert (
        f"train.device=cuda: no CUDA GPU is available here ({NO_GPU}); use train.device=cpu, "
        "or auto to take a GPU when there is one"
    ) in problems
    assert "engine.device=gpu: not a device name; use auto, cpu, cuda or cuda:N" in problems
    assert "train.micro_batch_tokens=0: must be >= 1 (e.g. 16384)" in problems
    assert "rollout.group_size=0" in problems  # reported together with the others
    with pytest.raises(ConfigError, match="float16 needs a CUDA device"):
        load_config(overrides=["train.dtype=float16"])
    with pytest.raises(ConfigError, match=r"engine.dtype=.*one of"):
        load_config(overrides=["engine.dtype=float64"])
    assert resolve_device("auto") == "cpu"
    cfg = load_config(overrides=["train.dtype=bfloat16", "engine.dtype=bfloat16"])
    assert (cfg.train.device, cfg.engine.device) == ("auto", "auto")


def test_a_cuda_device_number_beyond_the_machine_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problems("train", "cuda:1", "float16") == []
    assert device_problems("train", "cuda:2", "float32") == [
        "train.device=cuda:2: this machine has 2 CUDA device(s) (cuda:0 … cuda:1); pick one of "
        "them, or cuda / auto"
    ]
    assert resolve_device("auto") == "cuda"


def test_cuda_without_a_gpu_is_refused_by_the_train_command(
    capsys: pytest.CaptureFixture[str], no_gpu: None
) -> None:
    assert main(["train", "train.device=cuda", "engine.device=cuda:0", "run.live=false"]) == 2
    err = capsys.readouterr().err
    assert "train.device=cuda: no CUDA GPU is available here" in err
    assert "engine.device=cuda:0: no CUDA GPU is available here" in err
    assert "use engine.device=cpu, or auto" in err


def test_a_model_path_that_is_not_a_checkpoint_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "never"
    args = ["train", f"engine.model_path={tmp_path}", f"run.run_dir={run_dir}", "run.live=false"]
    assert main(args) == 2
    assert "not a Hugging Face checkpoint directory (no config.json)" in capsys.readouterr().err
    assert not run_dir.exists()


# -- the trainer: micro-batches and precision --------------------------------------------------------


def _groups(vocab: int, seed: int = 0) -> list[list[Trajectory]]:
    """Four groups of four trajectories of different lengths and rewards (fixed, seeded)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(4):
        group = []
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(4):
            out = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
            group.append(
                Trajectory(
                    prompt_ids=prompt,
                    output_ids=out,
                    behaviour_logprobs=[-rng.uniform(4.0, 7.0) for _ in out],
                    versions=[0] * len(out),
                    reward=float(rng.random() < 0.5),
                    metrics={"acc": 0.0},
                )
            )
        groups.append(group)
    return groups


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_the_gradient_of_one_big_batch(
    qwen2_dir: Path, loss_agg: str
) -> None:
    base = load_model(qwen2_dir)
    groups = _groups(base.config.vocab_size)
    grads = []
    for budget in (None, 48):
        model = copy.deepcopy(base)
        config = TrainConfig(
            micro_batch_tokens=budget,
            grad_clip=None,
            loss_agg=loss_agg,  # type: ignore[arg-type]
            entropy_coef=0.01,
            minibatches=2,
        )
        trainer = Trainer(model, config=config, pad_token_id=0)
        stats = trainer.step(groups)
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters()}, stats))
    (one, s1), (micro, s2) = grads
    lengths = [len(t.prompt_ids) + len(t.output_ids) for g in groups for t in g]
    assert len(trainer._micro_batches(torch.arange(8), lengths)) > 2  # it did split
    for name, g in one.items():
        torch.testing.assert_close(micro[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert s2.loss == pytest.approx(s1.loss, rel=1e-4, abs=1e-6)
    assert s2.entropy == pytest.approx(s1.entropy, rel=1e-4)
    assert s2.num_trained_tokens == s1.num_trained_tokens


def test_micro_batches_put_rows_of_like_length_together(qwen2_dir: Path) -> None:
    # a long-tailed batch: in order, every pass would pad a short row to a long one
    trainer = Trainer(load_model(qwen2_dir), config=TrainConfig(micro_batch_tokens=20))
    micros = trainer._micro_batches(torch.arange(4), [10, 2, 10, 2])
    assert [m.tolist() for m in micros] == [[1, 3], [0, 2]]  # 24 padded tokens, not 40


def test_bfloat16_losses_match_float32_on_a_fixed_batch(qwen2_dir: Path) -> None:
    from byom_checks import fixed_batch_losses

    fp32, bf16 = fixed_batch_losses(qwen2_dir, "cpu")
    assert bf16 == pytest.approx(fp32, rel=0.02)


def test_gradient_checkpointing_gives_the_same_step(qwen2_dir: Path) -> None:
    base = load_model(qwen2_dir)
    groups = _groups(base.config.vocab_size, seed=1)
    after = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        Trainer(
            model, config=TrainConfig(gradient_checkpointing=checkpointing), pad_token_id=0
        ).step(groups)
        after.append(model.state_dict())
    for name, value in after[0].items():
        torch.testing.assert_close(after[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_the_trainer_publishes_a_snapshot_on_the_models_device(qwen2_dir: Path) -> None:
    model = load_model(qwen2_dir)
    trainer = Trainer(model, config=TrainConfig(), pad_token_id=0)
    snapshot = trainer.state_dict_for_engines()
    weight = snapshot["lm_head.weight"]
    assert weight.device.type == "cpu"
    assert weight.data_ptr() != model.lm_head.weight.data_ptr()  # a copy, not a view
    with pytest.raises(ConfigError, match="float16 needs a CUDA device"):
        Trainer(model, config=TrainConfig(dtype="float16", device="auto"), pad_token_id=0)

"""The trainer on a tiny locally created Llama: batches, steps, statistics, publication, warm
start."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stalebound.core.errors import ConfigError  # noqa: E402
from stalebound.tasks import TaskConfig, Trajectory, make_task  # noqa: E402
from stalebound.train import TrainConfig, Trainer, evaluate, rollout_groups, warm_start  # noqa: E402
from stalebound.train.trainer import build_batch, token_logprobs  # noqa: E402
from train_helpers import BOS, EOS, PAD, CharTokenizer, tiny_llama  # noqa: E402

torch.set_num_threads(1)
TOK = CharTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def traj(
    model: object,
    prompt: str,
    answer: str,
    reward: float,
    *,
    versions: list[int] | None = None,
    truncated: bool = False,
    behaviour_shift: float = 0.0,
) -> Trajectory:
    """A trajectory whose behaviour log-probs are the model's own (plus ``behaviour_shift``)."""
    p = [BOS, *ids(prompt)]
    out = [*ids(answer), EOS]
    full = torch.tensor([p + out])
    with torch.no_grad():
        lp, _ = token_logprobs(model, full, torch.ones_like(full), with_entropy=False)
    behav = (lp[0, len(p) - 1 :] + behaviour_shift).tolist()
    return Trajectory(
        prompt_ids=p,
        output_ids=out,
        behaviour_logprobs=behav,
        versions=versions if versions is not None else [0] * len(out),
        reward=reward,
        truncated=truncated,
        metrics={"acc": reward},
    )


def seq_logprob(model: object, t: Trajectory) -> float:
    full = torch.tensor([t.prompt_ids + t.output_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, full, torch.ones_like(full), with_entropy=False)
    return float(lp[0, len(t.prompt_ids) - 1 :].sum())


def test_build_batch_aligns_tokens_with_their_logprobs() -> None:
    a = Trajectory([BOS, 5], [6, 7, EOS], [-1.0, -2.0, -3.0], [4, 4, 5], reward=1.0)
    b = Trajectory([BOS, 5, 8], [9], [-0.5], [3], reward=0.0, loss_mask=[0], truncated=True)
    batch = build_batch([a, b], pad_token_id=PAD)
    assert batch.input_ids.tolist() == [[BOS, 5, 6, 7, EOS], [BOS, 5, 8, 9, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.targets.tolist() == [[5, 6, 7, EOS], [5, 8, 9, PAD]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0.0, -1.0, -2.0, -3.0], [0.0, 0.0, -0.5, 0.0]]
    assert batch.versions.tolist() == [[0, 4, 4, 5], [0, 0, 3, 0]]
    assert batch.truncated.tolist() == [False, True]
    with pytest.raises(ConfigError, match="no prompt tokens"):
        build_batch([Trajectory([], [1], [0.0], [0], reward=0.0)], PAD)


def test_steps_raise_the_likelihood_of_rewarded_outputs() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    trainer = Trainer(model, TOK, TrainConfig(lr=1e-2, prox_mode="recompute", tis_cap=2.0))
    prompts = [("1+2=", "3", "7"), ("4+4=", "8", "5"), ("2+5=", "7", "1")]
    seen: list[int] = []
    trainer.publish(lambda sd, v: seen.append(v))
    first_good = first_bad = 0.0
    for step in range(6):
        groups = [
            [
                traj(model, p, good, 1.0, versions=[step] * 2),
                traj(model, p, bad, 0.0, versions=[step] * 2),
            ]
            for p, good, bad in prompts
        ]
        if step == 0:
            first_good = sum(seq_logprob(model, g[0]) for g in groups)
            first_bad = sum(seq_logprob(model, g[1]) for g in groups)
        stats = trainer.step(groups)
        assert stats.version == step + 1 and stats.batch_version == step
        assert stats.reward_mean == 0.5 and stats.zero_advantage_fraction == 0.0
        assert stats.staleness_max == 0 and stats.traj_staleness_max == 0
        assert stats.num_trained_tokens == 12 and stats.masked_fraction == 0.0
    assert trainer.version == 6 and seen == [1, 2, 3, 4, 5, 6]
    good = sum(seq_logprob(model, g[0]) for g in groups)
    bad = sum(seq_logprob(model, g[1]) for g in groups)
    assert good > first_good + 1.0
    assert bad < first_bad - 1.0


def test_loss_decreases_over_steps_on_a_fixed_batch() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size, seed=1)
    trainer = Trainer(
        model, TOK, TrainConfig(lr=5e-3, prox_mode="none", tis_cap=None, clip_eps=0.5)
    )
    groups = [[traj(model, "3+3=", "6", 1.0), traj(model, "3+3=", "9", 0.0)]]
    losses = [trainer.step(groups).loss for _ in range(5)]
    assert losses[-1] < losses[0]


def test_first_step_loss_and_ratio_stats_are_exact_on_policy() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size, seed=2)
    trainer = Trainer(model, TOK, TrainConfig())
    groups = [[traj(model, "1+1=", "2", 1.0), traj(model, "1+1=", "3", 0.0)]]
    st = trainer.step(groups)
    # on-policy: every ratio is 1; advantages ±1/sqrt(0.5)·... sum to zero with equal token counts
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert st.ratio_max == pytest.approx(1.0, abs=1e-5) and st.ratio_min == pytest.approx(
        1.0, abs=1e-5
    )
    assert st.kl_behaviour == pytest.approx(0.0, abs=1e-6) and st.clip_fraction == 0.0
    assert st.loss == pytest.approx(0.0, abs=1e-5)
    assert st.behaviour_weight_mean == pytest.approx(1.0, abs=1e-5)
    assert 0 < st.entropy < math.log(TOK.vocab_size) + 1e-3
    assert st.response_length == 2.0 and st.accuracy == 0.5


def test_staleness_statistics_use_per_token_versions_and_v_traj() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    trainer = Trainer(model, TOK, TrainConfig(), version=5)
    t1 = traj(model, "1+1=", "22", 1.0, versions=[3, 4, 5])
    t2 = traj(model, "1+1=", "2", 0.0, versions=[5, 5])
    t2.version = 4  # V_traj set by the executor at Reserve
    st = trainer.step([[t1, t2]])
    # trained tokens: 2, 1, 0 and 0, 0 → mean 0.6, max 2 ; V_traj 3 and 4 → 2 and 1
    assert st.staleness_mean == pytest.approx(0.6) and st.staleness_max == 2
    assert st.traj_staleness_mean == pytest.approx(1.5) and st.traj_staleness_max == 2
    assert st.batch_version == 5 and st.version == 6


def test_mask_truncated_and_rejection_are_counted() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    groups = [
        [
            traj(model, "1+1=", "2", 1.0),
            traj(model, "1+1=", "9999", 0.0, truncated=True),
        ]
    ]
    keep = Trainer(model, TOK, TrainConfig(mask_truncated=False)).step(groups)
    assert keep.masked_fraction == 0.0 and keep.num_trained_tokens == 7
    assert keep.truncated_fraction == 0.5
    masked = Trainer(model, TOK, TrainConfig(mask_truncated=True)).step(groups)
    assert masked.masked_fraction == pytest.approx(5 / 7) and masked.num_trained_tokens == 2
    # behaviour log-probs far below the model's: ρ = e^3 ≈ 20 > 2 → every token rejected
    off = [[traj(model, "1+1=", "2", 1.0, behaviour_shift=-3.0), traj(model, "1+1=", "3", 0.0)]]
    rej = Trainer(model, TOK, TrainConfig(rejection="sequence")).step(off)
    assert rej.masked_fraction == pytest.approx(0.5) and rej.ratio_max > 15


@pytest.mark.parametrize("prox_mode", ["recompute", "loglinear", "none"])
def test_minibatches_and_proximal_modes_run(prox_mode: str) -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    cfg = TrainConfig(
        minibatches=2,
        prox_mode=prox_mode,
        tis_cap=None if prox_mode == "none" else 2.0,  # type: ignore[arg-type]
    )
    trainer = Trainer(model, TOK, cfg, version=2)
    groups = [
        [
            traj(model, "1+1=", "2", 1.0, versions=[1, 2]),
            traj(model, "1+1=", "3", 0.0, versions=[0, 1]),
        ],
        [
            traj(model, "2+2=", "4", 1.0, versions=[2, 2]),
            traj(model, "2+2=", "5", 0.0, versions=[2, 2]),
        ],
    ]
    st = trainer.step(groups)
    assert trainer.version == 3 and st.num_trained_tokens == 8
    assert math.isfinite(st.loss) and st.staleness_max == 2


def test_state_dict_for_engines_is_a_cpu_copy() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    trainer = Trainer(model, TOK)
    sd = trainer.state_dict_for_engines()
    name = "model.embed_tokens.weight"
    assert sd[name].device.type == "cpu" and not sd[name].requires_grad
    before = sd[name].clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(sd[name], before)
    got = {}
    trainer.publish(lambda s, v: got.update(version=v, keys=set(s)))
    trainer.step([[traj(model, "1+1=", "2", 1.0), traj(model, "1+1=", "3", 0.0)]])
    assert got["version"] == 1 and name in got["keys"]


def test_invalid_train_config_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig(lr=0.0, prox_mode="none", tis_cap=2.0, rejection_high=0.5).validate()
    assert len(e.value.problems) == 3
    assert any("tis_cap=2.0 with prox_mode='none'" in p for p in e.value.problems)


def test_train_config_refuses_infinite_and_negative_optimizer_settings() -> None:
    bad = TrainConfig(
        lr=math.inf,
        weight_decay=-0.1,
        betas=(0.9, 1.0),
        grad_clip=math.inf,
        entropy_coef=math.nan,
        warm_start_lr=math.inf,
        clip_eps_high=math.inf,
    )
    assert bad.problems() == [
        "train.lr=inf: must be a finite number > 0 (1e-3 suits the tiny model)",
        "train.weight_decay=-0.1: must be a finite number >= 0",
        "train.betas=[0.9, 1.0]: must be two numbers in [0, 1), e.g. [0.9, 0.99]",
        "train.grad_clip=inf: must be a finite number > 0, or null to not clip",
        "train.clip_eps_high=inf: must be a finite number > 0 (0.28 is DAPO's)",
        "train.entropy_coef=nan: must be a finite number (0 is off)",
        "train.warm_start_lr=inf: must be a finite number > 0",
    ]
    assert TrainConfig(weight_decay=math.inf).problems() == [
        "train.weight_decay=inf: must be a finite number >= 0"
    ]


def test_warm_start_raises_task_reward_from_zero() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    cfg = TaskConfig(name="arithmetic")
    cfg.arithmetic.max_digits = 1
    task = make_task(cfg)
    held_out = task.generate_samples(100, seed=99)
    before = evaluate(model, TOK, task, held_out)
    assert before["score"] == 0.0
    stats = warm_start(model, TOK, task, 75, batch_size=64, lr=3e-3)
    assert stats.last_loss < stats.first_loss / 3
    after = evaluate(model, TOK, task, held_out)
    assert after["score"] >= 0.1
    assert after["response_length"] == pytest.approx(len("12") + 1, abs=0.6)


def test_rollout_groups_feed_the_trainer() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    task = make_task(TaskConfig(name="arithmetic"))
    groups = rollout_groups(model, TOK, task, task.generate_samples(3, seed=0), 4, version=0)
    assert [len(g) for g in groups] == [4, 4, 4]
    t = groups[0][0]
    assert len(t.output_ids) == len(t.behaviour_logprobs) == len(t.versions) > 0
    # the sampler's log-probs are the model's own: the trainer sees ratio 1
    st = Trainer(model, TOK).step(groups)
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert st.kl_behaviour == pytest.approx(0.0, abs=1e-4)


@pytest.mark.slow
def test_rl_after_warm_start_raises_the_sampled_reward() -> None:
    """The main job in miniature, synchronously: warm start, then GRPO steps on fresh samples."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=TOK.vocab_size)
    task = make_task(TaskConfig(name="arithmetic"))
    pool = task.generate_samples(2000, seed=0)
    warm_start(model, TOK, task, 40, samples=pool, batch_size=64, lr=3e-3)
    trainer = Trainer(model, TOK, TrainConfig())
    rng = torch.Generator().manual_seed(0)
    rewards = []
    for _ in range(70):
        idx = torch.randint(len(pool), (32,), generator=rng).tolist()
        groups = rollout_groups(
            model, TOK, task, [pool[i] for i in idx], 8, version=trainer.version
        )
        rewards.append(trainer.step(groups).reward_mean)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first > 0.1  # warm start gave a non-zero reward
    print(f"sampled reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last > first + 0.08, (first, last)


def test_demonstration_tokens_mask_prompt_and_tool_turns() -> None:
    from stalebound.train.warmstart import demonstration_tokens

    cfg = TaskConfig(name="calculator")
    task = make_task(cfg)
    from stalebound.tasks import Sample

    toks, mask = demonstration_tokens(TOK, task, Sample("0", "2*3+4", "10"))
    text = "".join(TOK.decode([t]) for t in toks)
    assert text == "<bos>2*3+4?[2*3]<eos>=6;[6+4]<eos>=10;10<eos>"
    trained = "".join(TOK.decode([t]) for t, m in zip(toks, mask, strict=True) if m)
    assert trained == "[2*3]<eos>[6+4]<eos>10<eos>"


@pytest.mark.slow
def test_multi_turn_rollouts_train_with_tool_tokens_masked() -> None:
    model = tiny_llama(vocab_size=TOK.vocab_size)
    cfg = TaskConfig(name="calculator", max_new_tokens=10)
    cfg.calculator.latency.distribution = "none"
    task = make_task(cfg)
    samples = task.generate_samples(2, seed=0)
    warm_start(model, TOK, task, 30, samples=task.generate_samples(200, seed=1), batch_size=32)
    groups = rollout_groups(model, TOK, task, samples, 2, version=0)
    trajs = [t for g in groups for t in g]
    assert all(t.loss_mask is not None for t in trajs)
    assert any(t.metrics["tool_calls"] >= 1 for t in trajs)  # warm start taught the call format
    st = Trainer(model, TOK).step(groups)
    assert st.num_trained_tokens == sum(t.num_trained_tokens for t in trajs)
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-4)

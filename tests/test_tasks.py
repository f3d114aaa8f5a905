"""Built-in tasks: prompts, rewards, metrics, data loading and the workflows."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stalebound.core.errors import ConfigError
from stalebound.runtime.cut import CutSignal
from stalebound.tasks import (
    CHARSET,
    LatencyConfig,
    RewardLatencyConfig,
    Sample,
    Task,
    TaskConfig,
    Turn,
    builtin_data_path,
    latency_problems,
    list_tasks,
    load_samples,
    make_task,
    register_task,
    sample_latency,
)
from stalebound.tasks.base import Trajectory
from stalebound.tasks.calculator import calculate, parse_tool_call
from stalebound.tasks.config import CalculatorConfig, StringsConfig
from stalebound.tasks.workflow import EpisodeEngine, as_workflow, encode_tool_reply
from train_helpers import EOS, CharTokenizer


def test_builtin_tasks_are_registered() -> None:
    assert {"arithmetic", "strings", "calculator"} <= set(list_tasks())


def test_unknown_task_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"task.name='nope'.*arithmetic"):
        make_task(TaskConfig(name="nope"))


def test_arithmetic_prompt_reward_and_metrics() -> None:
    task = make_task(TaskConfig(name="arithmetic"))
    s = Sample("0", "47+5", "52")
    assert task.prompt(s) == "47+5="
    assert task.reward(s, "52") == 1.0
    assert task.reward(s, "53") == 0.0
    assert task.metrics(s, "52") == {
        "score": 1.0,
        "acc": 1.0,
        "seq_reward": 1.0,
        "seq_final_reward": 1.0,
    }
    assert task.metrics(s, "52", truncated=True)["score"] == 0.0


def test_arithmetic_partial_credit_by_digits_from_the_right() -> None:
    task = make_task(TaskConfig(name="arithmetic", partial_credit=True))
    s = Sample("0", "47+5", "52")
    assert task.reward(s, "42") == pytest.approx(0.25)  # ones digit right: 0.5 * 1/2
    assert task.reward(s, "152") == pytest.approx(0.5 * 2 / 3)
    assert task.reward(s, "5a") == 0.0
    assert task.reward(s, "") == 0.0
    m = task.metrics(s, "42")
    assert m["score"] == pytest.approx(0.25) and m["acc"] == 0.0


def test_arithmetic_samples_are_seeded_correct_and_vary_in_length() -> None:
    cfg = TaskConfig(name="arithmetic")
    cfg.arithmetic.max_digits = 2
    task = make_task(cfg)
    a = task.generate_samples(300, seed=3)
    assert a == task.generate_samples(300, seed=3)
    assert a != task.generate_samples(300, seed=4)
    for s in a:
        x, y = s.question.split("+")
        assert int(x) + int(y) == int(s.answer)
    assert {len(s.answer) for s in a} == {1, 2, 3}


def test_arithmetic_operators_and_validation() -> None:
    cfg = TaskConfig(name="arithmetic")
    cfg.arithmetic.operators = "-*"
    task = make_task(cfg)
    for s in task.generate_samples(100, seed=0):
        assert eval(s.question) == int(s.answer) >= 0  # questions are plain integer arithmetic
    bad = TaskConfig(name="arithmetic")
    bad.arithmetic.operators = "/"
    bad.arithmetic.max_digits = 9
    with pytest.raises(ConfigError) as e:
        make_task(bad)
    assert len(e.value.problems) == 2


def test_strings_operations() -> None:
    cfg = TaskConfig(
        name="strings", strings=StringsConfig(operations=("reverse", "sort", "double"))
    )
    task = make_task(cfg)
    samples = task.generate_samples(200, seed=0)
    for s in samples:
        op, word = s.question.split(" ")
        expected = {"reverse": word[::-1], "sort": "".join(sorted(word)), "double": ""}[op]
        if op == "double":
            expected = "".join(c * 2 for c in word)
        assert s.answer == expected
        assert task.prompt(s) == f"{op} {word}?"
    assert len({len(s.answer) for s in samples}) > 3
    s = Sample("0", "reverse abc", "cba")
    assert task.reward(s, "cba") == 1.0 and task.reward(s, "cbx") == 0.0
    partial = make_task(TaskConfig(name="strings", partial_credit=True))
    assert partial.reward(s, "cbx") == pytest.approx(0.5 * 2 / 3)


def test_the_longtail_workload_has_a_heavy_tail_of_answer_lengths() -> None:
    from stalebound.config import BENCH_RECIPE, TRAIN_RECIPE, load_config

    cfg = load_config([TRAIN_RECIPE, BENCH_RECIPE.with_name("bench-longtail.yaml")])
    task = make_task(cfg.task)
    samples = task.samples()
    # reference responses in tokens: one per character (the charset tokenizer) and the end token
    lengths = sorted(len(s.answer) + 1 for s in samples)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    print(f"longtail answers: median {median}, p99 {p99}, max {lengths[-1]} tokens")
    assert p99 >= 15 * median
    assert 100 <= lengths[-1] <= cfg.task.max_new_tokens
    assert all(s.answer == s.data["word"] and s.question == f"copy {s.answer}" for s in samples)
    assert task.difficulty(samples[0]) == len(samples[0].answer)  # the default: answer length


def test_strings_lognormal_lengths_are_bounded() -> None:
    cfg = TaskConfig(name="strings", strings=StringsConfig(lengths="lognormal", max_length=201))
    with pytest.raises(ConfigError) as e:
        make_task(cfg)
    assert str(e.value) == (
        "task.strings.min_length=1, max_length=201: need 1 <= min_length <= max_length <= 200 "
        "(lengths=lognormal)"
    )
    uniform = TaskConfig(name="strings", strings=StringsConfig(max_length=17))
    with pytest.raises(ConfigError, match="max_length <= 16 "):
        make_task(uniform)


def test_every_prompt_and_answer_fits_the_charset() -> None:
    allowed = set(CHARSET)
    for name in ("arithmetic", "strings", "calculator"):
        task = make_task(TaskConfig(name=name))
        for s in task.generate_samples(50, seed=1):
            text = task.prompt(s) + "".join(t.text for t in task.demonstration(s))
            assert set(text) <= allowed, (name, text)


def test_builtin_data_files_load_and_are_correct() -> None:
    shipped = make_task(TaskConfig(name="arithmetic", data_path="builtin")).samples()
    assert len(shipped) == 2000
    for s in shipped:
        x, y = s.question.split("+")
        assert int(x) + int(y) == int(s.answer)
    assert {len(s.answer) for s in shipped} == {1, 2, 3}
    strings = make_task(TaskConfig(name="strings", data_path="builtin")).samples()
    assert all(s.answer == s.data["word"][::-1] for s in strings)
    calc = make_task(TaskConfig(name="calculator", data_path="builtin")).samples()
    assert all(int(s.answer) == s.data["a"] * s.data["b"] + s.data["c"] for s in calc)
    assert builtin_data_path("arithmetic").stat().st_size < 200_000


def test_data_script_regenerates_the_shipped_files(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    before = [builtin_data_path(n).read_bytes() for n in ("arithmetic", "strings", "calculator")]
    subprocess.run(
        [sys.executable, str(repo / "scripts" / "make_task_data.py")],
        check=True,
        env={"PYTHONPATH": str(repo / "src")},
    )
    after = [builtin_data_path(n).read_bytes() for n in ("arithmetic", "strings", "calculator")]
    assert after == before


def test_load_samples_jsonl_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"question": "1+2", "answer": 3, "level": 1}\n\n{"id": "x", "question": "2+2", "answer": "4"}\n'
    )
    samples = load_samples(p)
    assert samples == [Sample("0", "1+2", "3", {"level": 1}), Sample("x", "2+2", "4", {})]
    task = make_task(TaskConfig(name="arithmetic", data_path=str(p)))
    assert task.samples() == samples

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+2"}\n')
    with pytest.raises(ConfigError, match="missing \\['answer'\\]"):
        load_samples(bad)
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match="line 1: not JSON"):
        load_samples(bad)
    # any text loads; what a model's tokenizer cannot encode is refused against that tokenizer
    bad.write_text('{"question": "Natalia sold 48 clips.\\nHow many?", "answer": "72"}\n')
    assert load_samples(bad)[0].question == "Natalia sold 48 clips.\nHow many?"
    with pytest.raises(ConfigError, match=r"cannot read it \(No such file or directory\)"):
        load_samples(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "record",
    [
        '{"question": NaN, "answer": "3"}',
        '{"question": "1+2", "answer": ""}',
        '{"question": "  ", "answer": "3"}',
        '{"question": "1+2", "answer": null}',
        '{"question": "1+2", "answer": Infinity}',
        '{"question": ["1+2"], "answer": "3"}',
    ],
)
def test_records_without_a_usable_question_or_answer_are_refused(
    tmp_path: Path, record: str
) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"question": "1+1", "answer": "2"}\n' + record + "\n")
    with pytest.raises(ConfigError, match=r"record 1: .* is not a prompt one can train on"):
        load_samples(p)


def test_load_samples_parquet_needs_pyarrow(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="pip install pyarrow"):
            load_samples(p)
        return
    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"]}), p)
    assert load_samples(p) == [Sample("0", "1+1", "2", {})]


def test_register_a_user_task() -> None:
    @register_task("test_copy")
    class CopyTask(Task):
        def generate(self, rng, index):  # type: ignore[no-untyped-def]
            return Sample(str(index), "ab", "ab")

        def prompt(self, sample: Sample) -> str:
            return f"copy {sample.question}?"

        def demonstration(self, sample: Sample) -> tuple[Turn, ...]:
            return (Turn(sample.answer),)

        def reward(self, sample: Sample, response: str) -> float:
            return float(response == sample.answer)

    task = make_task(TaskConfig(name="test_copy", num_prompts=3))
    assert task.name == "test_copy" and len(task.samples()) == 3
    with pytest.raises(ConfigError, match="already registered"):
        register_task("test_copy")(lambda cfg: task)


@dataclass
class Gen:
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    output_versions: Sequence[int]
    finish_reason: str


class ScriptedModel:
    """Answers each turn from a script, recording what it was asked."""

    def __init__(self, tok: Any, turns: list[str], version: int = 3, eos: int = EOS) -> None:
        self.tok, self.turns, self.version, self.eos = tok, list(turns), version, eos
        self.calls: list[list[int]] = []
        self.limits: list[int] = []

    async def __call__(
        self, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]
    ) -> Gen:
        self.calls.append(list(input_ids))
        self.limits.append(max_new_tokens)
        text = self.turns.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)
        reason = "length" if len(ids) >= max_new_tokens else "stop"
        ids = ids[:max_new_tokens] if reason == "length" else [*ids, self.eos]
        self.version += 1
        return Gen(ids, [-0.5] * len(ids), [self.version] * len(ids), reason)


async def episode(task: Task, tok: Any, model: ScriptedModel, row: Sample) -> Trajectory:
    """One episode of ``task``'s workflow, generating with ``model``."""
    result = await task.workflow(tok).arun_episode(EpisodeEngine(model, tok, task), row)
    assert result is not None
    return result


def test_single_turn_workflow() -> None:
    tok = CharTokenizer()
    task = make_task(TaskConfig(name="arithmetic"))
    s = Sample("7", "12+30", "42")
    model = ScriptedModel(tok, ["42"])
    traj = asyncio.run(episode(task, tok, model, s))
    assert model.calls == [tok.encode("12+30=")]
    assert traj.prompt_ids == tok.encode("12+30=")
    assert traj.output_ids == [*tok.encode("42", add_special_tokens=False), EOS]
    assert traj.reward == 1.0 and not traj.truncated and traj.response == "42"
    assert traj.versions == [4, 4, 4] and traj.v_traj == 4 and traj.num_trained_tokens == 3
    long = asyncio.run(episode(task, tok, ScriptedModel(tok, ["4" * 20]), s))
    assert long.truncated and long.reward == 0.0 and len(long.output_ids) == 12


def test_calculator_tool_and_parser() -> None:
    assert parse_tool_call("[12*3]") == "12*3"
    assert parse_tool_call("36") is None
    assert calculate("12*3") == "=36;"
    assert calculate("40-52") == "=-12;"
    assert calculate("12/3") == "=err;"
    assert calculate("1+2+3") == "=err;"


def test_calculator_episode_masks_tool_tokens() -> None:
    tok = CharTokenizer()
    cfg = TaskConfig(name="calculator", calculator=CalculatorConfig())
    cfg.calculator.latency = LatencyConfig(distribution="constant", median_s=0.01)
    task = make_task(cfg)
    s = Sample("0", "37*24+15", "903")
    demo = task.demonstration(s)
    assert [t.text for t in demo] == ["[37*24]", "=888;", "[888+15]", "=903;", "903"]
    model = ScriptedModel(tok, [t.text for t in demo if t.role == "model"], version=0)
    traj = asyncio.run(episode(task, tok, model, s))
    assert traj.reward == 1.0 and traj.response == "903" and not traj.truncated
    assert traj.metrics["tool_calls"] == 2.0 and traj.metrics["tool_wait_s"] == pytest.approx(0.02)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    expected = [*enc("[37*24]"), EOS, *enc("=888;"), *enc("[888+15]"), EOS, *enc("=903;")]
    expected += [*enc("903"), EOS]
    assert traj.output_ids == expected
    mask = [1] * 8 + [0] * 5 + [1] * 9 + [0] * 5 + [1] * 4
    assert traj.loss_mask == mask
    assert [lp for lp, m in zip(traj.behaviour_logprobs, mask, strict=True) if not m] == [0.0] * 10
    assert traj.versions[8:13] == [1] * 5  # tool tokens carry the version of the turn before
    # the third model turn saw the prompt, both calls and both tool replies
    assert model.calls[2] == traj.prompt_ids + expected[:27]


def test_calculator_tool_replies_enter_as_chat_messages_with_a_chat_template() -> None:
    from stalebound.engines.models import build_bpe_tokenizer

    tok = build_bpe_tokenizer("qwen2")  # a ChatML template, as Qwen's
    cfg = TaskConfig(name="calculator")
    cfg.calculator.latency.distribution = "none"
    task = make_task(cfg)
    model = ScriptedModel(tok, ["[2*3]", "[6+4]", "10"], version=0, eos=tok.eos_token_id)
    traj = asyncio.run(episode(task, tok, model, Sample("0", "2*3+4", "10")))
    assert traj.reward == 1.0 and traj.response == "10"
    # each tool reply is a `tool` message of the template, then the next assistant turn opens
    text = tok.decode(traj.prompt_ids + traj.output_ids)
    assert text == (
        "<|im_start|>user\n2*3+4?<|im_end|>\n<|im_start|>assistant\n[2*3]<|im_end|>"
        "\n<|im_start|>tool\n=6;<|im_end|>\n<|im_start|>assistant\n[6+4]<|im_end|>"
        "\n<|im_start|>tool\n=10;<|im_end|>\n<|im_start|>assistant\n10<|im_end|>"
    )
    # the template's tokens are the environment's: masked from the loss
    masked = [t for t, m in zip(traj.output_ids, traj.loss_mask or [], strict=True) if not m]
    assert tok.decode(masked) == (
        "\n<|im_start|>tool\n=6;<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>tool\n=10;<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "arch, said, written",
    [
        ("qwen2", "[2*3]", "\n<|im_start|>tool\n=6;<|im_end|>\n<|im_start|>assistant\n"),
        ("qwen2", "", "\n<|im_start|>tool\n=6;<|im_end|>\n<|im_start|>assistant\n"),
        ("llama", "[2*3]", "=6;</s>"),  # the Llama-2-style template: every other turn + </s>
    ],
)
def test_a_tool_reply_is_what_the_template_writes_after_the_models_end_of_turn(
    arch: str, said: str, written: str
) -> None:
    from stalebound.engines.models import build_bpe_tokenizer

    tok = build_bpe_tokenizer(arch)
    messages = [{"role": "user", "content": "2*3+4?"}, {"role": "assistant", "content": said}]
    assert tok.decode(encode_tool_reply(tok, messages, "=6;")) == written
    with pytest.raises(ConfigError, match=r"^tokenizer.chat_template: rendering the conversation"):
        encode_tool_reply(tok, messages[:1], "=6;")  # no assistant turn to follow
    assert encode_tool_reply(CharTokenizer(), messages, "=6;") == CharTokenizer().encode(
        "=6;", add_special_tokens=False
    )


def test_a_workflow_of_the_earlier_interface_still_runs_and_warns() -> None:
    tok = CharTokenizer()
    task = make_task(TaskConfig(name="arithmetic"))

    class Old:
        async def run(self, generate: Any, sample: Sample) -> Trajectory:
            gen = await generate(tok.encode("1+1="), 5, [EOS])
            return Trajectory([], list(gen.output_ids), [0.0] * 2, [0] * 2, reward=1.0)

    with pytest.warns(
        DeprecationWarning,
        match=r"Old.run\(generate, sample\) is deprecated.*"
        r"define async arun_episode\(self, engine, row\)",
    ):
        workflow = as_workflow(Old())
    model = ScriptedModel(tok, ["2"])
    traj = asyncio.run(
        workflow.arun_episode(EpisodeEngine(model, tok, task), Sample("0", "1+1", "2"))
    )
    assert traj is not None and traj.output_ids == [*tok.encode("2", add_special_tokens=False), EOS]
    assert model.calls == [tok.encode("1+1=")] and model.limits == [5]


def test_a_workflow_generates_from_chat_messages_or_token_ids() -> None:
    from stalebound.engines.models import build_bpe_tokenizer

    tok = build_bpe_tokenizer("qwen2")
    task = make_task(TaskConfig(name="arithmetic"))
    model = ScriptedModel(tok, ["a", "b"], eos=tok.eos_token_id)
    engine = EpisodeEngine(model, tok, task)
    chat = asyncio.run(engine.agenerate([{"role": "user", "content": "2+3="}]))
    assert tok.decode(chat.input_ids) == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    ids = asyncio.run(engine.agenerate([5, 6], max_new_tokens=3))
    assert ids.input_ids == (5, 6) and model.calls == [list(chat.input_ids), [5, 6]]
    plain = EpisodeEngine(ScriptedModel(CharTokenizer(), []), CharTokenizer(), task)
    with pytest.raises(
        ConfigError,
        match=r"messages with roles \['system', 'user'\]: the "
        "tokenizer has no chat template",
    ):
        plain.encode([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


def test_calculator_runs_out_of_turns() -> None:
    tok = CharTokenizer()
    cfg = TaskConfig(name="calculator")
    cfg.calculator.max_turns = 2
    cfg.calculator.latency.distribution = "none"
    traj = asyncio.run(
        episode(
            make_task(cfg), tok, ScriptedModel(tok, ["[1+1]", "[2+2]"]), Sample("0", "2*3+4", "10")
        )
    )
    assert traj.truncated and traj.reward == 0.0 and traj.metrics["tool_calls"] == 2.0


def test_tool_calls_really_wait() -> None:
    tok = CharTokenizer()
    cfg = TaskConfig(name="calculator")
    cfg.calculator.latency = LatencyConfig(distribution="constant", median_s=0.05)
    model = ScriptedModel(tok, ["[2*3]", "10"])
    t0 = time.perf_counter()
    traj = asyncio.run(episode(make_task(cfg), tok, model, Sample("0", "2*3+4", "10")))
    assert time.perf_counter() - t0 >= 0.05
    assert traj.metrics["tool_wait_s"] == pytest.approx(0.05)


def test_a_calculator_episode_cut_during_its_tool_call_ends_truncated_at_once() -> None:
    tok = CharTokenizer()
    cfg = TaskConfig(name="calculator")
    cfg.calculator.latency = LatencyConfig(distribution="constant", median_s=3600.0, cap_s=3600.0)
    model = ScriptedModel(tok, ["[2*3]", "10"], version=0)
    signal = CutSignal()

    async def cut_episode() -> Trajectory:
        signal.enter()  # what the executor does in each member's task
        return await episode(make_task(cfg), tok, model, Sample("0", "2*3+4", "10"))

    async def main() -> Trajectory:
        task = asyncio.ensure_future(cut_episode())
        while not model.calls:  # the first turn is generated, then the tool call starts
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        signal.cut()  # an hour's tool call: only the cut can end it
        return await asyncio.wait_for(task, 60)

    traj = asyncio.run(main())
    assert traj.truncated and traj.reward == 0.0 and len(model.calls) == 1
    assert traj.output_ids == [*tok.encode("[2*3]", add_special_tokens=False), EOS]
    assert traj.metrics["tool_calls"] == 1.0 and traj.metrics["tool_wait_s"] == 0.0


@pytest.mark.parametrize("dist", ["lognormal", "pareto"])
def test_latency_distributions_are_heavy_tailed_capped_and_seeded(dist: str) -> None:
    import random

    cfg = LatencyConfig(distribution=dist, median_s=0.1, sigma=1.0, alpha=1.2, cap_s=3.0)
    rng = random.Random(0)
    xs = sorted(sample_latency(cfg, rng) for _ in range(4000))
    median, p99 = xs[2000], xs[3960]
    assert 0.08 < median < 0.12
    assert p99 > 5 * median  # a long tail
    assert max(xs) <= 3.0
    assert sample_latency(cfg, random.Random(5)) == sample_latency(cfg, random.Random(5))


def test_calculator_rejects_bad_latency_settings() -> None:
    cfg = TaskConfig(name="calculator")
    cfg.calculator.latency = LatencyConfig(distribution="weibull", alpha=0.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        make_task(cfg)
    assert len(e.value.problems) == 2


def test_reward_latency_is_off_by_default_and_adds_no_metric() -> None:
    tok = CharTokenizer()
    task = make_task(TaskConfig(name="arithmetic"))
    assert task.config.reward_latency.distribution == "none"
    traj = asyncio.run(episode(task, tok, ScriptedModel(tok, ["5"]), Sample("0", "2+3", "5")))
    assert traj.reward == 1.0 and "reward_wait_s" not in traj.metrics


@pytest.mark.parametrize(
    "name, script, question, answer",
    [
        ("arithmetic", ["5"], "2+3", "5"),
        ("calculator", ["[2*3]", "[6+4]", "10"], "2*3+4", "10"),
    ],
)
def test_rewards_really_wait_for_the_verifier(
    name: str, script: list[str], question: str, answer: str
) -> None:
    tok = CharTokenizer()
    cfg = TaskConfig(name=name, reward_latency=RewardLatencyConfig("constant", median_s=0.05))
    cfg.calculator.latency.distribution = "none"
    task = make_task(cfg)
    t0 = time.perf_counter()
    traj = asyncio.run(
        episode(task, tok, ScriptedModel(tok, script), Sample("0", question, answer))
    )
    assert time.perf_counter() - t0 >= 0.05
    assert traj.reward == 1.0 and traj.metrics["reward_wait_s"] == pytest.approx(0.05)


def test_reward_latency_draws_differ_within_a_group_and_replay_the_same() -> None:
    def draws() -> list[float]:
        cfg = TaskConfig(reward_latency=RewardLatencyConfig("lognormal", median_s=0.1))
        task = make_task(cfg)
        a, b = Sample("a", "1+1", "2"), Sample("b", "1+2", "3")
        return [task.reward_delay(s) for s in (a, a, a, b, a)]

    first = draws()
    assert len(set(first[:3])) == 3  # three members of one group wait three different times
    assert first == draws()  # a new run of the same seed waits the same


def test_bad_reward_latency_is_reported_with_the_tasks_own_problems() -> None:
    cfg = TaskConfig(
        name="calculator",
        reward_latency=RewardLatencyConfig("weibull", median_s=-1.0),  # type: ignore[arg-type]
    )
    cfg.calculator.max_turns = 0
    with pytest.raises(ConfigError) as e:
        make_task(cfg)
    assert e.value.problems == (
        "task.reward_latency.distribution='weibull': use one of none, constant, lognormal, pareto",
        "task.reward_latency.median_s=-1.0, cap_s=2.0: must be finite numbers >= 0 (seconds)",
        "task.calculator.max_turns=0: must be >= 1",
    )


def test_latency_settings_must_be_finite() -> None:
    nan, inf = float("nan"), float("inf")
    assert latency_problems(LatencyConfig(median_s=nan, sigma=inf, alpha=inf), "x") == [
        "x.median_s=nan, cap_s=2.0: must be finite numbers >= 0 (seconds)",
        "x.sigma=inf: must be a finite number >= 0",
        "x.alpha=inf: must be a finite number > 0 (1.5 is typical)",
    ]
    assert latency_problems(LatencyConfig(cap_s=inf), "x") == [
        "x.median_s=0.05, cap_s=inf: must be finite numbers >= 0 (seconds)"
    ]


def test_tasks_and_train_config_import_no_torch() -> None:
    code = "import stalebound.tasks, stalebound.train, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_jsonl_round_trip_of_generated_samples(tmp_path: Path) -> None:
    task = make_task(TaskConfig(name="strings"))
    samples = task.generate_samples(5, seed=9)
    p = tmp_path / "s.jsonl"
    p.write_text(
        "\n".join(
            json.dumps({"id": s.id, "question": s.question, "answer": s.answer, **s.data})
            for s in samples
        )
    )
    assert load_samples(p) == samples

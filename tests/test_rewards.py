"""Reward functions: named from the command line, checked once, every failure counted as data."""

from __future__ import annotations

import asyncio
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stalebound.core.errors import ConfigError
from stalebound.rewards import (
    RewardFunction,
    RewardOutcome,
    extract_answer,
    numeric_match,
    outcome_of,
    parse_number,
    regex_match,
)


def write(tmp_path: Path, source: str, name: str = "my_rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def score(fn: RewardFunction, completion: str, **columns: Any) -> RewardOutcome:
    return asyncio.run(fn.score("the prompt", completion, columns))


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("She sold 72 clips. #### 72", "72", 1.0),
        ("so \\boxed{1,234} is it", "Natalia... #### 1234", 1.0),
        ("The answer is $5.00.", "5", 1.0),
        ("The answer is 6", "5", 0.0),
        ("−3", "-3", 1.0),
        ("no number here", "3", 0.0),
    ],
)
def test_numeric_match_reads_gsm8k_boxed_and_plain_answers(
    completion: str, answer: str, reward: float
) -> None:
    assert numeric_match("p", completion, answer)["reward"] == reward


def test_extraction_prefers_the_last_boxed_then_hashes() -> None:
    assert extract_answer("x \\boxed{\\frac{1}{2}} y #### 3") == "\\frac{1}{2}"
    assert extract_answer("work... #### 42\n") == "42"
    assert parse_number("12.5%") == 12.5 and parse_number("none") is None
    assert regex_match("p", " 72 apples ", r"\d+ apples") == 1.0


def test_a_function_in_a_file_is_called_with_the_columns_it_names(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        def score(prompt, completion, answer, level=0):
            return {"reward": float(completion == answer), "level": level}
        """,
    )
    fn = RewardFunction(f"{path}:score", columns=["answer", "level", "source"])
    out = score(fn, "72", answer="72", level=2, source="web")
    assert out == RewardOutcome(1.0, {"level": 2.0})


def test_builtin_names_and_modules_load() -> None:
    assert score(RewardFunction("exact"), " 72 ", answer="72").reward == 1.0
    fn = RewardFunction("stalebound.rewards.builtin:numeric_match")
    assert score(fn, "#### 7", answer="7") == RewardOutcome(1.0, {"parsed": 1.0})


def test_an_async_reward_is_awaited(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        import asyncio
        async def judge(prompt, completion, **columns):
            await asyncio.sleep(0)
            return len(completion)
        """,
    )
    assert score(RewardFunction(f"{path}:judge"), "abc").reward == 3.0


@pytest.mark.parametrize(
    ("body", "failure", "detail"),
    [
        ("raise ValueError('bad answer format')", "raised", "ValueError: bad answer format"),
        ("return float('nan')", "nan", "the reward is nan"),
        ("return None", "none", "the reward is None"),
        ("return 'yes'", "not_a_number", "the reward is str 'yes'"),
        (
            "return {'score': 1}",
            "not_a_number",
            "the mapping has no 'reward' key (keys: ['score'])",
        ),
        ("return {'reward': 1, 'len': 'x'}", "not_a_number", "metric 'len' is str 'x'"),
    ],
)
def test_a_reward_that_fails_is_an_outcome_with_its_cause(
    tmp_path: Path, body: str, failure: str, detail: str
) -> None:
    path = write(tmp_path, f"def r(prompt, completion, **columns):\n    {body}\n")
    out = score(RewardFunction(f"{path}:r"), "x")
    assert (out.reward, out.failure, out.detail) == (None, failure, detail)


def test_a_reward_that_never_returns_times_out(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        import asyncio
        async def hang(prompt, completion, **columns):
            await asyncio.Event().wait()
        """,
    )
    out = score(RewardFunction(f"{path}:hang", timeout_s=0.01), "x")
    assert out.failure == "timeout" and out.reward is None


def test_a_sync_reward_runs_in_worker_processes_and_a_hung_one_is_replaced(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        import time
        def r(prompt, completion, **columns):
            if completion == "hang":
                time.sleep(3600)
            return len(completion)
        """,
    )
    fn = RewardFunction(f"{path}:r", workers=1, timeout_s=20)
    try:
        assert score(fn, "four").reward == 4.0
        fn.timeout_s = 0.5
        assert score(fn, "hang").failure == "timeout"
        fn.timeout_s = 20
        assert score(fn, "again").reward == 5.0  # a fresh pool took over
    finally:
        fn.close()


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        ("x = 1\n", "{path}:missing", "has no 'missing' (it defines ['x']); name one of them"),
        (
            "x = 1\n",
            "{path}:x",
            "names a int, not a function; name a function reward(prompt, completion, **columns)",
        ),
        (
            "def r(completion):\n    return 1\n",
            "{path}:r",
            "takes 1 positional argument(s), but a reward is called with the prompt and the completion; define it as def reward(prompt, completion, **columns)",
        ),
        (
            "def r(p, c, solution):\n    return 1\n",
            "{path}:r",
            "r needs ['solution'], which the data does not have (its columns: ['answer']); give those parameters defaults, rename them after columns, or take **columns",
        ),
        (
            "import not_a_module_anywhere\n",
            "{path}:r",
            "failed (ModuleNotFoundError: No module named 'not_a_module_anywhere'); fix the file",
        ),
        ("def r(:\n", "{path}:r", "failed (SyntaxError"),
        (
            "",
            "no_such_package_xyz.rewards:r",
            "no module named 'no_such_package_xyz'; install it, add its directory to PYTHONPATH, or name a file: path/to/file.py:name",
        ),
        (
            "",
            "justaname",
            "not a 'module:name' reference; write e.g. task.reward=my_package.rewards:score or task.reward=rewards.py:score",
        ),
    ],
)
def test_a_reward_that_cannot_be_used_is_one_config_error(
    tmp_path: Path, source: str, spec: str, message: str
) -> None:
    path = write(tmp_path, source, name=f"bad_{abs(hash(spec))}.py")
    with pytest.raises(ConfigError) as e:
        RewardFunction(spec.format(path=path), columns=["answer"])
    assert message in str(e.value)
    assert str(e.value).startswith(f"task.reward={spec.format(path=path)!r}: ")
    assert "\n" not in str(e.value)


def test_outcomes_of_plain_values() -> None:
    assert outcome_of(True) == RewardOutcome(1.0)
    assert outcome_of(math.inf).failure == "nan"

"""HumanEval as a task source, and the code reward that runs its tests in the sandbox."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from adarl.config import RewardConfig, TaskConfig, load_recipe
from adarl.rewards import Rewards
from adarl.rewards import code as code_reward
from adarl.tasks import build_task
from adarl.tasks.humaneval import N_PROBLEMS, read_rows
from adarl.types import Group, Rollout

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, str]]:
    return {r["task_id"]: r for r in read_rows()}


def he(**kw: object) -> TaskConfig:
    return TaskConfig(**{"source": "humaneval", "eval_size": 64, **kw})


# ---------------------------------------------------------------- the task source


def test_problems_prompts_and_columns() -> None:
    task = build_task(he(system_prompt="You write Python."), seed=0)
    assert task.name == "humaneval" and len(task.train) + len(task.eval) == N_PROBLEMS == 164
    p = next(p for p in task.train + task.eval if p.id == "HumanEval/0")
    assert p.answer is None
    assert set(p.columns) == {"test", "entry_point", "prompt_code", "question"}
    assert p.columns["entry_point"] == "has_close_elements"
    assert p.columns["prompt_code"].startswith("from typing import List")
    assert "def check(candidate)" in p.columns["test"]
    system, user = p.prompt
    assert system == {"role": "system", "content": "You write Python."}
    assert user["role"] == "user" and "def has_close_elements(" in user["content"] and "```python" in user["content"]


def test_held_out_split_is_seeded_and_disjoint() -> None:
    a, b = build_task(he(), seed=0), build_task(he(), seed=5)  # the training seed plays no part
    assert [p.id for p in a.eval] == [p.id for p in b.eval] and len(a.eval) == 64 and len(a.train) == 100
    assert not {p.id for p in a.train} & {p.id for p in a.eval}
    c = build_task(he(data_seed=1))
    assert {p.id for p in c.eval} != {p.id for p in a.eval}
    everything = build_task(he(eval_size=500), seed=0)
    assert len(everything.eval) == 164 and everything.train == []


def test_a_recipe_with_humaneval_and_a_code_reward_validates() -> None:
    recipe = load_recipe(data={"task": {"source": "humaneval", "eval_size": 64},
                               "rewards": [{"type": "code", "sandbox_timeout_s": 3}]})
    assert recipe.task.source == "humaneval" and recipe.rewards[0].type == "code"
    assert recipe.rewards[0].sandbox_timeout_s == 3 and recipe.rewards[0].sandbox_memory_mb == 512


# ---------------------------------------------------------------- building the program


@pytest.mark.parametrize(("completion", "expected"), [
    ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1\n"),
    ("first\n```py\nx = 1\n```\nthen\n```python\nx = 2\n```\nbye", "x = 2\n"),  # the last block
    ("```\nx = 3\n```", "x = 3\n"),  # an untagged fence
    ("```bash\nrm -rf /\n```\n```python\nx = 4\n```", "x = 4\n"),
    ("```bash\nls\n```", "```bash\nls\n```"),  # no Python block: the raw text
    ("```python\ndef g():\n    return 5", "def g():\n    return 5"),  # cut off at the token limit
    ("    return a + b\n", "    return a + b\n"),  # a bare body
])
def test_extract_program(completion: str, expected: str) -> None:
    assert code_reward.extract_program(completion) == expected


def test_build_program_full_function_or_body() -> None:
    cols = {"prompt_code": "import math\n\ndef f(x):\n    \"\"\"Doc.\"\"\"\n", "entry_point": "f",
            "test": "def check(candidate):\n    assert candidate(4) == 2\n"}
    body = code_reward.build_program("    return math.isqrt(x)\n", cols)
    assert body.startswith(cols["prompt_code"] + "    return math.isqrt(x)\n") and body.endswith("check(f)\n")
    full = code_reward.build_program("```python\ndef f(x):\n    return 2\n```", cols)
    assert full.startswith(cols["prompt_code"] + "\n\ndef f(x):")  # the prompt's imports stay available


# ---------------------------------------------------------------- scoring in the sandbox


@linux_only
def test_canonical_solutions_pass_and_cheats_fail(rows: dict[str, dict[str, str]]) -> None:
    task = build_task(he(eval_size=164), seed=0)
    by_id = {p.id: p for p in task.eval}
    for task_id in ("HumanEval/0", "HumanEval/38", "HumanEval/163"):  # 38 needs a helper from its prompt
        p, row = by_id[task_id], rows[task_id]
        assert code_reward.score(row["canonical_solution"], p.columns) == 1.0
        fenced = f"Sure!\n```python\n{row['prompt']}{row['canonical_solution']}```\nDone."
        assert code_reward.score(fenced, p.columns) == 1.0
    p = by_id["HumanEval/0"]
    for cheat in ("```python\nimport sys\nsys.exit(0)\n```", "```python\nimport os\nos._exit(0)\n```",
                  "```python\nraise SystemExit\n```", "    return True\n", "```python\ndef has_close_elements(:\n```",
                  "```python\nimport sys\nprint(sys.stdin.read())\n```"):
        assert code_reward.score(cheat, p.columns) == 0.0, cheat
    with pytest.raises(ValueError, match="'test' column"):
        code_reward.score("x = 1", {})


@linux_only
def test_code_reward_through_the_worker_pool(rows: dict[str, dict[str, str]]) -> None:
    task = build_task(he(eval_size=164), seed=0)
    p = next(q for q in task.eval if q.id == "HumanEval/2")  # truncate_number
    good = f"```python\ndef truncate_number(number: float) -> float:\n{rows[p.id]['canonical_solution']}```"
    texts = [good, "```python\ndef truncate_number(number):\n    return 0.0\n```",
             "```python\ndef truncate_number(number):\n    while True:\n        pass\n```",
             rows[p.id]["canonical_solution"]]
    group = Group(p, [1], [Rollout(p.id, [1], [-0.1], "stop", text=t) for t in texts])
    with Rewards([RewardConfig(type="code", sandbox_timeout_s=1.0)], workers=2, timeout_s=5.0) as rewards:
        metrics = rewards.score([group])
    np.testing.assert_array_equal(group.rewards[:, 0], [1.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(group.correct, [1.0, 0.0, 0.0, 1.0])
    assert metrics["reward/code"] == 0.5
    assert metrics["reward_errors"] == metrics["reward_timeouts"] == metrics["reward_crashes"] == 0

"""log.rollouts_every: every rollout of every k-th step in rollouts.jsonl, and the best/worst in the report."""

import html
import json

import pytest

from adarl.config import load_recipe
from adarl.train.trainer import Trainer
from test_train import recipe_data, write_task


@pytest.fixture
def tests_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))


def test_rollouts_logged_every_k_steps_and_shown_in_the_report(tiny_model_dir, tmp_path, tests_path):
    task = write_task(tmp_path)

    def recipe(steps):
        return load_recipe(data=recipe_data(
            tiny_model_dir, task, budget={"max_steps": steps, "prompts_per_step": 2},
            allocate={"name": "fixed", "n": 3},
            rewards=[{"type": "callable", "function": "e2e_rewards:contains_a"}],
            log={"tensorboard": False, "progress": False, "rollouts_every": 2}, checkpoint={"every": 2}))

    run = tmp_path / "run"
    Trainer(recipe(4), run).run()
    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted({x["step"] for x in lines}) == [2, 4]
    for step in (2, 4):
        rows = [x for x in lines if x["step"] == step]
        assert len(rows) == metrics[step]["step_rollouts"] == 6  # every rollout of the step
        for x in rows:
            assert set(x) >= {"prompt", "completion", "rewards", "reward", "advantage", "length", "finish_reason"}
            assert x["reward"] == pytest.approx(sum(x["rewards"].values()))
            assert x["reward"] == float("a" in x["completion"])
            assert x["prompt"].startswith("Say a ")
        # GRPO: rewards equal within the group → advantage 0; otherwise the sign follows the reward
        for pid in {x["prompt_id"] for x in rows}:
            group = [x for x in rows if x["prompt_id"] == pid]
            mean = sum(x["reward"] for x in group) / len(group)
            for x in group:
                assert x["advantage"] == 0.0 if x["reward"] == mean else (x["advantage"] > 0) == (x["reward"] > mean)
    page = (run / "report.html").read_text()
    assert "Sampled rollouts" in page and "best" in page
    latest = [x for x in lines if x["step"] == 4]
    best = max(latest, key=lambda x: x["reward"])
    assert html.escape(best["completion"][:40]) in page

    # a resumed run drops the lines of steps after its checkpoint, so nothing is logged twice
    with open(run / "rollouts.jsonl", "a") as f:
        f.write(json.dumps({**lines[-1], "step": 5}) + "\n")  # as if killed after step 5's log, before its checkpoint
    Trainer(recipe(6), run).run(resume=True)
    steps = [json.loads(x)["step"] for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [2, 4, 6] and steps.count(6) == 6

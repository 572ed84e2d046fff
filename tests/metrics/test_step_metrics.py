"""The signal metrics of a step, recomputed by hand from the per-prompt log of the same run.

DARS runs two generate/verify stages a step, so every "over the step" metric must cover both.
The reward is 0/1 (contains an 'a'), so a rollout's reward and its correctness coincide.
"""

import json

import numpy as np
import pytest

from adarl.config import load_recipe
from adarl.train.trainer import Trainer
from test_train import recipe_data, write_task

MODES = {
    # two stages a step
    "dars": {"allocate": {"name": "dars", "n": 4, "n_max": 8, "schedule": "equal"}},
    # groups finished from tokens sampled in earlier steps: the step's own tokens are not its groups'
    "partial": {"allocate": {"name": "fixed", "n": 4},
                "rollout": {"temperature": 1.0, "max_new_tokens": 8,
                            "scheduler": {"mode": "partial", "over_provision": 2.0}}},
}


@pytest.fixture(params=sorted(MODES))
def run(request, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path.parent))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    recipe = load_recipe(data=recipe_data(
        tiny_model_dir, write_task(tmp_path), **MODES[request.param],
        rewards=[{"type": "callable", "function": "e2e_rewards:slow_contains_a"}],
        budget={"max_steps": 3, "prompts_per_step": 4}, log={"tensorboard": False, "progress": False}))
    Trainer(recipe, tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    prompts = [json.loads(x) for x in (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()]
    return request.param, rows, prompts


def test_signal_metrics_match_the_prompt_log(run):
    mode, rows, prompts = run
    stage2 = 0
    sampled_so_far = useful_so_far = wasted_so_far = 0
    pool_size = 36  # write_task's 40 problems less the 4 held out
    for row in rows:
        step = [p for p in prompts if p["step"] == row["step"]]
        n = np.array([p["n"] for p in step])
        correct = np.array([p["correct"] for p in step])
        assert row["rollouts_per_prompt_mean"] == pytest.approx(n.mean())
        assert (row["rollouts_per_prompt_min"], row["rollouts_per_prompt_max"]) == (n.min(), n.max())
        assert row["zero_variance_fraction"] == pytest.approx(np.mean((correct == 0) | (correct == n)))
        # every stage's rollouts, not the last stage's only
        assert row["reward/slow_contains_a"] == pytest.approx(correct.sum() / n.sum())
        assert row["pass_rate"] == pytest.approx(correct.sum() / n.sum())
        # DARS keeps groups with 0 < accuracy < 1 (fixed keeps all); GRPO gives a non-zero advantage to
        # each rollout of a mixed group and 0 to the others
        mixed = (correct > 0) & (correct < n)
        tokens = [sum(p["lengths"]) for p in step]
        expected = sum(t for t, m in zip(tokens, mixed, strict=True) if m) / sum(tokens)
        assert row["effective_token_fraction"] == pytest.approx(expected)
        # the same tokens as counts: sampled, useful (mixed groups), wasted (groups with equal rewards)
        assert row["tokens/sampled"] == sum(tokens)
        assert row["tokens/useful"] == sum(t for t, m in zip(tokens, mixed, strict=True) if m)
        assert row["tokens/zero_variance"] == sum(t for t, m in zip(tokens, mixed, strict=True) if not m)
        sampled_so_far += sum(tokens)
        useful_so_far += row["tokens/useful"]
        wasted_so_far += row["tokens/zero_variance"]
        assert row["tokens/useful_cumulative"] == useful_so_far
        assert row["tokens/zero_variance_cumulative"] == wasted_so_far
        assert row["effective_token_fraction_cumulative"] == pytest.approx(useful_so_far / sampled_so_far)
        assert row["zero_variance_token_fraction_cumulative"] == pytest.approx(wasted_so_far / sampled_so_far)
        if mode == "dars":  # (partial mode's groups may be of prompts chosen in earlier steps)
            # what the store knew of the step's prompts before it: visits in earlier steps of the log
            earlier = [q["prompt_id"] for q in prompts if q["step"] < row["step"]]
            visits = [earlier.count(q["prompt_id"]) for q in step]
            assert row["selected/unseen_fraction"] == pytest.approx(np.mean([v == 0 for v in visits]))
            assert row["selected/visits_mean"] == pytest.approx(np.mean(visits))
            assert row["pool/visited_fraction"] == pytest.approx(len(set(earlier)) / pool_size)
        if mode == "dars":
            assert row["step_rollouts"] == n.sum() and row["step_tokens"] == sum(tokens)
        stage2 += row.get("allocate/stage2_rollouts", 0)
    assert mode != "dars" or stage2 > 0  # a second stage ran, so "over every stage" was exercised


def test_timings_are_counted_once(run):
    _, rows, _ = run
    for row in rows:
        # the parts of a step cannot add up to more than the step (verify_s was counted twice)
        parts = row["generate_s"] + row["verify_s"] + row["train_s"] + row["weight_sync_s"]
        assert parts <= row["step_s"] + 1e-6, row
        assert row["verify_s"] >= 0.02 * row["rollouts_per_prompt_mean"] * row["groups"] * 0.9  # 20 ms a rollout

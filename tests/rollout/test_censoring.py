"""Censoring everywhere (design.md: "censored: the environment or sandbox failed: excluded from group
statistics, counted, never scored 0"). An infrastructure failure censors the rollout in every scheduler
mode (an environment that raised) and on the reward path (a reward worker that crashed or timed out, a
code sandbox that could not start, a reward raising `ScoringFailure`); a failure *of* the completion
scores as the reward says. Each filter has a test here that fails without it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adarl.config import RewardConfig, SchedulerConfig
from adarl.rewards import Rewards, ScoringFailure
from adarl.rewards import callable as user_fn
from adarl.rewards import code as code_reward
from adarl.rewards.sandbox import SandboxResult
from adarl.rollout import build_scheduler
from adarl.rollout.agent import EnvironmentFailure
from adarl.types import Group, Problem, Request, Rollout
from test_agent_partial import Tally, setup


class DiesOnFive(Tally):
    """The tool's backend dies when asked to add 5 (script key 1): the environment failed, not the model."""

    def add(self, x: int) -> str:
        """Add x to the total."""
        if x == 5:
            raise EnvironmentFailure("the backend is gone")
        return super().add(x)


@pytest.mark.parametrize("mode", ["sync", "partial", "async"])
def test_an_environment_failure_is_censored_in_every_scheduler_mode(mode):
    agent, gen, prompt = setup(DiesOnFive)
    cfg = {"sync": SchedulerConfig(), "partial": SchedulerConfig(mode="partial", over_provision=1.0),
           "async": SchedulerConfig(mode="async", eta=0, over_provision=1.0)}[mode]
    sched = build_scheduler(agent, cfg)
    try:
        result = sched.run([Request("p", prompt, 4)])
    finally:
        sched.close()
    # scripts (test_agent_partial.py): key 0 adds 1 and 2, key 1 adds 5 (censored), key 2 calls nothing,
    # key 3 adds 4 three times: the group keeps 3 of its 4 rollouts, none of them censored
    (group,) = result.groups
    assert sorted(r.text for r in group.rollouts) == ["It is 12.", "No tools needed.", "The total is 3."]
    assert all(r.finish_reason != "censored" for r in group.rollouts)
    assert result.metrics["rollouts_censored"] == 1


# ------------------------------------------------------------------ the reward path


def group_of(texts: list[str], **columns) -> Group:
    return Group(Problem("p", "q", "a", dict(columns)), [5, 6], [Rollout("p", [1, 2], [-0.1, -0.2], text=t)
                                                               for t in texts])


def test_a_reward_that_cannot_score_censors_and_a_wrong_completion_scores_zero():
    with Rewards([RewardConfig(type="callable", function="reward_fns:unscorable_reward")], workers=1) as rewards:
        up, down = group_of(["right", "wrong"]), group_of(["right", "wrong"], down=True)
        metrics = rewards.score([up, down])
    # up: scored as the reward says (1 for right, 0 for wrong: a failure of the completion is a score)
    assert [r.text for r in up.rollouts] == ["right", "wrong"] and up.rewards[:, 0].tolist() == [1.0, 0.0]
    # down: the service failed, not the completions: censored, removed from the group, never scored 0
    assert down.rollouts == [] and down.rewards.shape == (0, 1)
    assert metrics["reward_censored"] == 2 and metrics["reward_errors"] == 0
    assert metrics["reward/unscorable_reward"] == 0.5  # the mean over the rollouts kept


def test_a_code_sandbox_that_cannot_start_censors(monkeypatch):
    # was: RuntimeError, a reward error scored 0
    died = SandboxResult("sandbox_error", None, "", "", 0.0, reason="the launcher died")
    monkeypatch.setattr(code_reward.sandbox, "run_code", lambda *a, **k: died)
    columns = {"test": "assert f() == 1"}
    with pytest.raises(ScoringFailure, match="the launcher died"):
        code_reward.score("def f():\n    return 1\n", columns)
    assert user_fn.call_fn(code_reward.reward, "q", "def f(): return 1", None, columns) == user_fn.CENSORED


def test_code_that_raises_is_a_failure_of_the_completion():
    if "error" in code_reward.sandbox.sandbox_capabilities():
        pytest.skip("no sandbox here")
    columns = {"test": "assert f() == 1"}
    assert code_reward.score("def f():\n    raise ValueError('no')\n", columns) == 0.0  # scored, not censored
    assert code_reward.score("def f():\n    return 1\n", columns) == 1.0


def test_the_trainer_drops_what_its_reward_censored(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Say a {i}", "answer": "a", "down": i % 2 == 0}) + "\n"
                            for i in range(12)))
    data = recipe_data(tiny_model_dir, task, budget={"max_steps": 1, "prompts_per_step": 4},
                       rewards=[{"type": "callable", "function": "reward_fns:unscorable_reward"}],
                       allocate={"name": "fixed", "n": 2}, log={"tensorboard": False, "progress": False})
    data["task"]["eval_size"] = 0
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    row = trainer.train_step()
    downs = [p for p in trainer.last_groups if p.problem.columns["down"]]
    assert downs == [] and trainer.last_groups  # only the scorable problems' groups train
    kept = sum(g.size for g in trainer.last_groups)
    assert row["reward_censored"] == 8 - kept and all(np.all(g.rewards == 1.0) for g in trainer.last_groups)

"""Every objective-zoo component trains end to end, composed with the others, on the tiny model."""

import json

import numpy as np
import pytest

from adarl import registry
from adarl.config import load_recipe
from adarl.train.trainer import Trainer
from test_train import recipe_data, scheduled_recipe, tests_on_path, write_task  # noqa: F401  (fixture)

# one recipe per line: every shaping, estimator, token weighting and loss appears at least once
COMBOS = {
    "rloo+overlong+d3s+hapo": dict(advantage={"name": "rloo"}, shaping=[{"name": "overlong", "buffer": 4}],
                                   tokens=[{"name": "d3s", "f0": 0.5}], loss={"name": "hapo"}),
    # e1's row sums to its R_AEC, 0 while nothing is correct (the tiny model): an entropy bonus trains the groups
    "e1+entropy_bonus": dict(shaping=[{"name": "e1"}], loss={"name": "ppo_clip", "entropy_coef": 0.01},
                             rollout={"temperature": 1.0, "max_new_tokens": 16,
                                      "effort_sentences": {"efforts": [0.5, 1.0]}}),
    # room to stop: the filter drops every rollout cut at max_new_tokens, so some must end before it
    "overlong_filter": dict(tokens=[{"name": "overlong_filter"}], loss={"name": "ppo_clip"},
                            rollout={"temperature": 1.0, "max_new_tokens": 48}),
    "reinforce_pp+length+high_entropy+bapo": dict(
        advantage={"name": "reinforce_pp"}, shaping=[{"name": "length_penalty", "only_correct": False}],
        tokens=[{"name": "high_entropy", "top": 0.5}], loss={"name": "bapo"},
        train={"lr": 0.02, "micro_batch_tokens": 64, "mini_batches": 2}),
    "xrpo+gspo+entropy_bonus": dict(advantage={"name": "xrpo"},
                                    loss={"name": "gspo", "entropy_coef": 0.01}),
    "hapo_adv+aepo+adaptive_temperature": dict(advantage={"name": "hapo"}, loss={"name": "aepo"},
                                               rollout={"temperature": 1.0, "max_new_tokens": 8,
                                                        "adaptive_temperature": {"tau": 0.05}}),
    "rdpo+hbpo+kl_k2": dict(advantage={"name": "rdpo"}, shaping=[{"name": "hbpo", "max_len": 8}],
                            loss={"name": "ppo_clip", "kl_coef": 0.01, "kl": "k2"}),
    "hbpo+fapo+kl_k1": dict(advantage={"name": "hbpo", "max_len": 8},
                            shaping=[{"name": "hbpo", "max_len": 8},
                                     {"name": "fapo", "judge": "shaping_judges:flawed_if_marked", "workers": 1}],
                            loss={"name": "ppo_clip", "kl_coef": 0.01, "kl": "k1"}),
    "polychromic": dict(advantage={"name": "polychromic", "n": 2, "subsets": 8}, loss={"name": "ppo_clip"}),
}
# trained end to end where their inputs exist: trees (tests/rollout/test_branching_policies.py), hinted groups
# (tests/objectives/test_hints.py); grpo/drgrpo: tests/e2e/test_train.py; decoupled_ppo: the partial-rollouts test below
ELSEWHERE = {"grpo", "drgrpo", "decoupled_ppo", "treepo", "treerl", "adhint"}


@pytest.mark.parametrize("name", list(COMBOS))
def test_components_train_together(name, tiny_model_dir, tmp_path, tests_on_path):  # noqa: F811
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 4})
    data.update(COMBOS[name])
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    last = trainer.run()
    assert last["step"] == 3
    assert np.isfinite(last["loss"]) and np.isfinite(last["grad_norm"])
    for spec in data.get("shaping", []):
        column = registry.component_class("shaping", spec["name"]).column
        assert f"reward/{column}" in last
    if data.get("tokens"):
        assert 0.0 < last["tokens/kept_fraction"] <= 1.0
    if data["loss"]["name"] == "bapo":  # the bounds' values are checked by hand in tests/objectives/test_bapo.py
        assert "bapo_c_low" in last and "bapo_c_high" in last
    if "adaptive_temperature" in data.get("rollout", {}):
        assert trainer.generator.entropy_stats is not None  # handed over after each step


def test_every_registered_component_is_covered():
    used = {(stage, spec["name"]) for combo in COMBOS.values()
            for stage in ("advantage", "loss") if stage in combo for spec in [combo[stage]]}
    used |= {(stage, spec["name"]) for combo in COMBOS.values() for stage in ("shaping", "tokens")
             for spec in combo.get(stage, [])}
    for stage in ("shaping", "advantage", "tokens", "loss"):
        missing = set(registry.names(stage)) - {n for s, n in used if s == stage} - ELSEWHERE
        assert not missing, f"{stage} components never trained end to end: {missing}"


def test_partial_rollouts_train_and_resume_exactly(tiny_model_dir, tmp_path, tests_on_path):  # noqa: F811
    """APRIL partial mode with the decoupled loss: trains, carries partials, and a resumed run matches."""
    data = scheduled_recipe(tiny_model_dir, write_task(tmp_path), {"mode": "partial", "over_provision": 2.0,
                                                                   "max_age": 2}, max_steps=4)
    straight = Trainer(load_recipe(data=data), tmp_path / "straight")
    straight.run()
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["groups"] == 2 for r in rows if "groups" in r)
    assert any(r.get("rollout/tokens_reused", 0) > 0 for r in rows)  # partials really were continued
    assert max(r["rollout/token_age_max"] for r in rows if "groups" in r) <= 2
    # the budget counts tokens sampled, finished or not
    assert rows[-1]["tokens"] == sum(r["rollout/tokens_generated"] for r in rows if "groups" in r)

    first = Trainer(load_recipe(data={**data, "budget": {"max_steps": 2, "prompts_per_step": 2}}), tmp_path / "split")
    first.run()
    assert first.rollouts.buffer  # partials in flight at the checkpoint
    resumed = Trainer(load_recipe(data=data), tmp_path / "split")
    resumed.run(resume=True)
    again = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, again, strict=True):
        assert a["step"] == b["step"] and a.get("reward") == b.get("reward") and a["tokens"] == b["tokens"]

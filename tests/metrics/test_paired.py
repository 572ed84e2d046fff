"""Issue 22: paired differences over seeds, pass@1 intervals, curves (value at the budget, AUC, tokens to
target) and one held-out set per comparison (task.data_seed), each with numbers worked by hand."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

import adarl.comparison as comparison
from adarl.config import TaskConfig, load_recipe
from adarl.stats import holm, mean_ci, paired, t_quantile, t_test_p, wilson
from adarl.tasks import build_task

# ---------------------------------------------------------------- paired differences


def test_paired_differences_by_hand():
    # differences 0.1, 0.2, 0.3: mean 0.2, s = sqrt((0.01 + 0 + 0.01) / 2) = 0.1,
    # half-width t(0.975, 2) · s / √3 = 4.3027 · 0.1 / 1.7321 = 0.24842 -> [-0.0484, 0.4484]: spans 0
    out = paired({0: 0.6, 1: 0.7, 2: 0.8}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert out["per_seed"] == pytest.approx({0: 0.1, 1: 0.2, 2: 0.3})
    assert out["mean"] == pytest.approx(0.2) and out["std"] == pytest.approx(0.1)
    assert out["ci95"] == pytest.approx([0.2 - 0.24842, 0.2 + 0.24842], abs=1e-4)
    assert (out["wins"], out["losses"], out["ties"]) == (3, 0, 0)
    assert out["verdict"] == "no winner"  # three wins out of three, and still no winner


def test_paired_verdict_only_when_the_interval_excludes_zero():
    # differences 0.10, 0.12, 0.14: mean 0.12, s 0.02, half-width 4.3027 · 0.02 / √3 = 0.04968 -> [0.0703, 0.1697]
    better = paired({0: 0.60, 1: 0.62, 2: 0.64}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert better["ci95"] == pytest.approx([0.12 - 0.04968, 0.12 + 0.04968], abs=1e-4)
    assert better["verdict"] == "better"
    worse = paired({0: 0.40, 1: 0.38, 2: 0.36}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert worse["verdict"] == "worse" and (worse["wins"], worse["losses"]) == (0, 3)
    # a cost (lower is better): 0.12 more tokens per seed is worse
    assert paired({0: 0.60, 1: 0.62, 2: 0.64}, {0: 0.5, 1: 0.5, 2: 0.5}, higher_is_better=False)["verdict"] == "worse"


def test_paired_uses_only_seeds_both_have_and_counts_ties():
    # seed 2 has no baseline run, seed 3 no value: pairs are seeds 0 and 1, differences 0.0 (a tie) and 0.1
    out = paired({0: 0.5, 1: 0.6, 2: 0.9, 3: None}, {0: 0.5, 1: 0.5, 3: 0.4})
    assert out["n"] == 2 and set(out["per_seed"]) == {0, 1}
    assert (out["wins"], out["losses"], out["ties"]) == (1, 0, 1)
    one = paired({0: 0.9}, {0: 0.5})
    assert one["n"] == 1 and one["ci95"] is None and one["verdict"] == "n/a"


def test_one_t_quantile_for_compare_and_xrpo():
    from adarl.allocate import xrpo

    assert xrpo.t_quantile is t_quantile
    assert not hasattr(comparison, "t975")
    # exact forms: t(0.975, 1) = tan(0.475π) = 12.7062; t(0.975, 2) = 0.95 / sqrt(2 · 0.975 · 0.025) = 4.3027
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-4)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)  # table value
    assert t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)
    with pytest.raises(ValueError, match="at least 2 values"):
        t_quantile(0.975, 0)


# ---------------------------------------------------------------- one run's pass@1


def test_wilson_interval_by_hand():
    # p = 0.5, n = 400, z = 1.96: centre 0.5; half = 1.96 · sqrt(0.25/400 + 3.8415/640000) / (1 + 3.8415/400)
    # = 1.96 · 0.025120 / 1.009604 = 0.048767
    lo, hi = wilson(0.5, 400)
    assert (lo, hi) == pytest.approx((0.5 - 0.048767, 0.5 + 0.048767), abs=1e-5)
    # p = 0, n = 10: centre (0 + 3.8415/20) / 1.38415 = 0.13876, half 1.96 · sqrt(3.8415/400) / 1.38415 = 0.13876
    lo, hi = wilson(0.0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-4)
    with pytest.raises(ValueError):
        wilson(0.5, 0)


def test_default_eval_size_keeps_one_pass1_within_five_points():
    # 385 problems give 1.96 · sqrt(0.25 / 385) = 0.04994 ≤ 0.05 at the worst p = 0.5; the default is 400
    n = TaskConfig(name="basic_arithmetic").eval_size
    assert n == 400
    lo, hi = wilson(0.5, n)
    assert (hi - lo) / 2 <= 0.05
    assert 1.96 * math.sqrt(0.25 / 384) > 0.05  # 384 would not be enough


# ---------------------------------------------------------------- curves


CURVE = [(100, 0.2), (200, 0.4), (300, 0.3)]  # first eval at 100 tokens, last at 300


def test_value_at_the_budget():
    assert comparison.at_tokens(CURVE, 150) == pytest.approx(0.3)  # halfway from 0.2 to 0.4
    assert comparison.at_tokens(CURVE, 250) == pytest.approx(0.35)
    assert comparison.at_tokens(CURVE, 50) == pytest.approx(0.2)  # held at the first eval before it
    assert comparison.at_tokens(CURVE, 400) == pytest.approx(0.3)  # held at the last eval after it
    assert comparison.at_tokens([], 100) is None


def test_normalised_auc_of_hand_curves():
    # budget 400: [0, 100] at 0.2 (held) = 20; [100, 200] (0.2+0.4)/2·100 = 30; [200, 300] 35;
    # [300, 400] at 0.3 (held) = 30 -> 115 / 400 = 0.2875
    assert comparison.normalised_auc(CURVE, 400) == pytest.approx(0.2875)
    # budget 250 cuts the curve at 0.35: 20 + 30 + (0.4+0.35)/2·50 = 68.75 -> 0.275
    assert comparison.normalised_auc(CURVE, 250) == pytest.approx(0.275)
    assert comparison.normalised_auc([(0, 0.5), (100, 0.5)], 100) == pytest.approx(0.5)  # flat: its value
    assert comparison.normalised_auc([(0, 0.0), (100, 1.0)], 100) == pytest.approx(0.5)  # a ramp: half
    assert comparison.normalised_auc([], 100) is None


def test_tokens_to_target_per_seed():
    # start 0.2 + gain 0.1 = 0.3: crossed between (100, 0.2) and (200, 0.4) at 100 + 0.1/0.2·100 = 150
    assert comparison.tokens_to(CURVE, 0.3) == pytest.approx(150)
    assert comparison.tokens_to(CURVE, 0.4) == pytest.approx(200)  # exactly at an eval
    assert comparison.tokens_to(CURVE, 0.45) is None  # never reached
    assert comparison.tokens_to(CURVE, 0.3, budget=120) is None  # reached, but after the budget
    assert comparison.tokens_to(CURVE, 0.1) == 100  # starts above the target: reached at its first eval


# ---------------------------------------------------------------- one held-out set per comparison


def _ids(problems):
    return [p.id for p in problems]


def test_data_seed_fixes_the_held_out_set_whatever_the_training_seed():
    cfg = {"name": "basic_arithmetic", "size": 200, "eval_size": 30}
    a = build_task(TaskConfig(**cfg), seed=0)  # `seed`: the training seed, as the trainer passes it
    b = build_task(TaskConfig(**cfg), seed=1)
    assert _ids(a.eval) == _ids(b.eval) and _ids(a.train) == _ids(b.train)
    c = build_task(TaskConfig(**cfg, data_seed=1), seed=0)
    assert set(_ids(c.eval)) != set(_ids(a.eval))
    assert len(set(_ids(c.eval)) & set(_ids(a.eval))) < 10  # another split, not a shifted one


def test_task_seed_is_the_deprecated_name_of_data_seed():
    with pytest.warns(FutureWarning, match=r"task.seed is deprecated: it is now task.data_seed"):
        cfg = TaskConfig(name="basic_arithmetic", seed=5)
    assert cfg.data_seed == 5 and "seed" not in cfg.model_dump()
    with pytest.raises(ValueError, match="task.seed .*and task.data_seed .*disagree"):
        TaskConfig(name="basic_arithmetic", seed=5, data_seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TaskConfig(name="basic_arithmetic", data_seed=5).data_seed == 5  # no warning for the new name


def test_default_eval_size_is_halved_on_a_small_file_and_recorded(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(90)))
    recipe = load_recipe(data={"task": {"source": "jsonl", "path": str(path)}})
    task = build_task(recipe.task, recipe.seed)
    assert len(task.eval) == 45 and len(task.train) == 45  # 2 · 400 > 90 distinct: half held out
    assert recipe.task.eval_size == 45  # written back, so config.yaml (and a resume) has it
    explicit = load_recipe(data={"task": {"source": "jsonl", "path": str(path), "eval_size": 10}})
    assert len(build_task(explicit.task).eval) == 10 and explicit.task.eval_size == 10
    humaneval = TaskConfig(source="humaneval")  # 164 problems: 82 held out, 82 to train on
    task = build_task(humaneval)
    assert len(task.eval) == len(task.train) == 82 and humaneval.eval_size == 82


def test_trainers_with_two_seeds_share_the_held_out_set_but_not_the_order(tiny_model_dir, tmp_path, monkeypatch):
    """The trainer's selector draws with the training seed; the problems come from the data seed."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    task = write_task(tmp_path)
    trainers = []
    for seed in (0, 1):
        data = recipe_data(tiny_model_dir, task, seed=seed, select={"name": "uniform"},
                           log={"tensorboard": False, "progress": False})
        trainers.append(Trainer(load_recipe(data=data), tmp_path / f"run{seed}"))
    a, b = trainers
    assert _ids(a.task.eval) == _ids(b.task.eval) and _ids(a.task.train) == _ids(b.task.train)
    order_a = a.selector.select(a.store, 8, a.np_rng)
    order_b = b.selector.select(b.store, 8, b.np_rng)
    assert order_a != order_b  # 36 training problems: two seeds drawing the same 8 in order is ~1e-12


def test_mean_ci_ignores_missing_values():
    # None is a missing run, not a zero: mean of 0.4 and 0.6 is 0.5
    assert mean_ci([0.4, None, 0.6])["mean"] == pytest.approx(0.5) and mean_ci([0.4, None, 0.6])["n"] == 2


def test_holm_step_down_by_hand():
    # p = a 0.01, b 0.04, c 0.03 (m = 3): sorted a, c, b; adjusted a 3 x 0.01 = 0.03, c max(0.03, 2 x 0.03) = 0.06,
    # b max(0.06, 1 x 0.04) = 0.06 (the running maximum keeps the order); only a is rejected at 0.05
    out = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert {k: round(v["holm_p"], 12) for k, v in out.items()} == {"a": 0.03, "b": 0.06, "c": 0.06}
    assert {k: v["holm_verdict"] for k, v in out.items()} == {"a": "reject", "b": "keep", "c": "keep"}
    # uncorrected, b and c would pass at 0.05; a test with too few seeds leaves the family
    out = holm({"a": 0.5, "b": None, "c": 0.02})
    assert out["c"]["holm_p"] == pytest.approx(0.04) and out["b"] == {"holm_p": None, "holm_verdict": "n/a"}
    # b 2 x 0.8 capped at 1; a max(1, 0.9) = 1: the running maximum, not a's own 0.9
    assert holm({"a": 0.9, "b": 0.8})["a"]["holm_p"] == 1.0


def test_paired_t_test_p_value_by_hand():
    # diffs 1, 2, 3: mean 2, s 1, t = 2 sqrt(3) on 2 dof; P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)) = 0.962910
    assert t_test_p([1.0, 2.0, 3.0]) == pytest.approx(2 * (1 - (0.5 + 12**0.5 / (2 * 14**0.5))), rel=1e-9)
    assert paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0})["p"] == pytest.approx(0.074180, abs=1e-6)
    assert t_test_p([0.0, 0.0]) == 1.0 and t_test_p([0.1, 0.1]) == 0.0 and t_test_p([0.3]) is None

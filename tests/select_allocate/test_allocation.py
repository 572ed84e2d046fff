"""Selection and allocation: hand-computed counts, budgets respected, seeded statistics, state."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adarl import registry
from adarl.allocate.dars import extra_rollouts
from adarl.allocate.xrpo import Xrpo, half_width, t_quantile
from adarl.budget import Budget
from adarl.select.base import Stateless
from adarl.select.gdro import pass_at_k_latest
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout
from allocation_groups import drive_step


def group(pid: str, correct: list[int], length: int = 5) -> Group:
    rollouts = [Rollout(pid, [1] * length, [0.0] * length, "stop") for _ in correct]
    c = np.array(correct, dtype=float)
    return Group(Problem(pid, "q"), [0], rollouts, rewards=c[:, None], reward_names=("short_answer",), correct=c)


# ---------------------------------------------------------------- DARS (algorithms.md §2.1)

@pytest.mark.parametrize("a,schedule,use_std,expected", [
    # a = 1/8: S = 2·(1/8)(7/8) = 0.21875, A_peak = 4, A_cur = 1.75
    (0.125, "equal", False, 11),       # (4 − 1.75)/0.21875 = 10.29 → 11
    (0.125, "hardness", False, 24),    # (2·(7/8)·4 − 1.75)/0.21875 = 24 → min(24, 32 − 8)
    # a = 0 → 0.5/8 = 0.0625: S = 0.1171875, A_cur = 0.9375; ET: 26.1 → 27, capped at 24
    (0.0, "equal", False, 24),
    # a = 1/4: S = 0.375, A_cur = 3; ET: (4 − 3)/0.375 = 2.67 → 3; HW: (6 − 3)/0.375 = 8
    (0.25, "equal", False, 3),
    (0.25, "hardness", False, 8),
    # use_std: S = 2·sqrt(0.1875) = 0.8660, A_peak = 8, A_cur = 6.928; ET: 1.238 → 2
    (0.25, "equal", True, 2),
    (0.5, "hardness", False, 0),
    (0.75, "equal", False, 0),
])
def test_dars_schedule(a, schedule, use_std, expected):
    assert extra_rollouts(a, 8, 32, schedule, use_std) == expected


def test_dars_two_stages_and_filter():
    store = DifficultyStore(["a", "b", "c"])
    dars = registry.build("allocate", {"name": "dars", "n": 8, "n_max": 32, "schedule": "equal"})
    problems = [Problem(q, "x") for q in "abc"]
    assert dars.plan(problems, store, Budget()) == {"a": 8, "b": 8, "c": 8}
    groups = [group("a", [1] + [0] * 7), group("b", [1] * 8), group("c", [1, 1, 1, 1, 0, 0, 0, 0])]
    assert dars.more(groups, store, Budget()) == {"a": 11}  # b (a=1) and c (a=0.5) get nothing
    assert dars.more(groups, store, Budget()) == {}
    kept = dars.finish(groups)
    assert [g.problem.id for g in kept] == ["a", "c"]  # all-correct b dropped


# ---------------------------------------------------------------- XRPO (§2.2)

@pytest.mark.parametrize("dof,expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (5, 2.5706),
                                          (10, 2.2281), (30, 2.0423)])
def test_t_quantile(dof, expected):
    assert t_quantile(0.975, dof) == pytest.approx(expected, rel=2e-3)


def test_xrpo_half_width_and_allocation():
    # n = 4, s = 0.5: t_{0.975,3} = 3.1824 → 3.1824 · 0.5 / 2 = 0.7956
    assert half_width(4, 0.5, 0.05) == pytest.approx(0.7956, rel=2e-3)
    store = DifficultyStore(["sure", "unsure"])
    xrpo = Xrpo(n=8, n0=4, chunk=2, bonus_scale=0.0)
    problems = [Problem("sure", "x"), Problem("unsure", "x")]
    assert xrpo.plan(problems, store, Budget()) == {"sure": 4, "unsure": 4}
    stage1 = [group("sure", [1, 1, 1, 1]), group("unsure", [1, 0, 1, 0])]
    store.update(stage1, step=1)
    # 16 in all, 8 spent; without the bonus only the uncertain prompt shrinks its interval
    assert xrpo.more(stage1, store, Budget()) == {"unsure": 8}


def test_xrpo_bonus_splits_equal_prompts():
    store = DifficultyStore(["p", "q"])
    xrpo = Xrpo(n=8, n0=4, chunk=2, bonus_scale=1.0)
    problems = [Problem("p", "x"), Problem("q", "x")]
    xrpo.plan(problems, store, Budget())
    stage1 = [group("p", [1, 0, 1, 0]), group("q", [0, 1, 0, 1])]
    store.update(stage1, step=3)
    assert xrpo.more(stage1, store, Budget()) == {"p": 4, "q": 4}


# ---------------------------------------------------------------- budgets (property tests)

ALLOCATORS = [
    {"name": "fixed", "n": 8}, {"name": "dapo", "n": 4, "max_batches": 3},
    {"name": "dars", "n": 4, "n_max": 16, "schedule": "hardness"}, {"name": "dars", "n": 4, "schedule": "equal"},
    {"name": "xrpo", "n": 8}, {"name": "xrpo", "n": 6, "bonus": "linear"}, {"name": "gdro", "n_mean": 6},
    {"name": "roc", "n": 4}, {"name": "brorl", "n": 64},
]


@settings(max_examples=25, deadline=None, database=None)
@given(spec=st.sampled_from(ALLOCATORS), limit=st.integers(1, 200), k=st.integers(1, 8),
       seed=st.integers(0, 10_000))
def test_allocators_never_exceed_the_step_rollouts(spec, limit, k, seed):
    """The rollout bound, allocator by allocator (tests/rollout/test_budget.py checks both bounds through the
    scheduler in every mode: the token bound needs the generator's hard cap)."""
    rng = np.random.default_rng(seed)
    ids = [f"p{i}" for i in range(40)]
    store = DifficultyStore(ids)
    for step in range(3):  # a random reward history
        store.update([group(q, rng.integers(0, 2, size=rng.integers(1, 9)).tolist(), length=rng.integers(1, 20))
                      for q in rng.choice(ids, size=10, replace=False)], step)
    allocator = registry.build("allocate", spec)
    budget = Budget(rollouts_per_step=limit, expected_length=8)
    budget.start_step()
    want = allocator.candidates(k)
    problems = [Problem(q, "x") for q in rng.choice(ids, size=min(want, len(ids)), replace=False)]
    drive_step(allocator, problems, store, budget, rng, 4, make=group)


def test_fit_is_exact_and_proportional():
    from adarl.allocate.base import fit

    budget = Budget(rollouts_per_step=10)
    budget.start_step()
    # 4, 4, 12 asked for, 10 allowed: 10·(4,4,12)/20 = (2, 2, 6)
    assert fit({"a": 4, "b": 4, "c": 12}, budget) == {"a": 2, "b": 2, "c": 6}
    budget.step_rollouts = 9
    assert sum(fit({"a": 4, "b": 4}, budget).values()) == 1


# ---------------------------------------------------------------- selectors (seeded statistics)

def test_vade_prefers_uncertain_prompts():
    ids = [f"p{i}" for i in range(300)]
    store = DifficultyStore(ids)
    store.alpha[:100], store.beta[:100] = 20.0, 20.0   # p ≈ 0.5: the most signal
    store.alpha[100:200], store.beta[100:200] = 40.0, 1.0  # p ≈ 0.98: almost always solved
    store.alpha[200:], store.beta[200:] = 1.0, 40.0  # p ≈ 0.02: almost never solved
    vade = registry.build("select", {"name": "vade", "pool": 4.0})
    rng = np.random.default_rng(0)
    picks = np.concatenate([vade.select(store, 16, rng) for _ in range(200)])
    share = np.mean(picks < 100)
    assert share > 0.9, share  # uniform would give 1/3
    assert len(set(vade.select(store, 16, rng))) == 16


def test_vade_decay_forgets_old_evidence():
    store = DifficultyStore(["a", "b"], gamma_short=0.5, gamma_long=0.9)
    store.update([group("a", [1] * 8)], step=1)
    assert (store.alpha[0], store.beta[0]) == (9.0, 1.0)
    store.update([group("a", [0] * 8)], step=2)  # short scale first: 1 + 0.5·8 = 5, then + 0 / + 8
    assert (store.alpha[0], store.beta[0]) == (5.0, 9.0)
    store.step = 12  # steps 3..11 sat out (9 steps): evidence shrinks by 0.9^9 toward Beta(1, 1)
    a, b = store.posterior(np.array([0]))
    assert a[0] == pytest.approx(1 + 0.9**9 * 4) and b[0] == pytest.approx(1 + 0.9**9 * 8)


def test_gdro_weights_move_to_the_hard_bin():
    ids = [f"p{i}" for i in range(100)]
    store = DifficultyStore(ids)
    gdro = registry.build("select", {"name": "gdro", "bins": 5, "k": 4})
    rng = np.random.default_rng(1)
    for step in range(1, 30):
        idx = np.array(gdro.select(store, 20, rng))
        # prompts 0..49 are always failed, the rest always solved
        groups = [group(ids[i], [0] * 4 if i < 50 else [1] * 4) for i in idx]
        store.update(groups, step)
        gdro.observe(store, groups)
    w = gdro.weights
    assert w[0] == w.max() and w[0] > 2 / 5  # bin 0 holds the pass@k = 0 prompts: over twice uniform
    assert w[4] < 0.1  # the always-solved prompts (pass@k = 1) sink toward the mixing floor
    assert w.min() >= 0.1 / 5 - 1e-12  # the uniform mix keeps every bin alive
    assert np.isclose(w.sum(), 1.0)
    assert np.allclose(store.gdro_weights, w)


def test_pass_at_k_latest():
    store = DifficultyStore(["a", "b", "c"])
    store.last_n[:] = [8, 8, 0]
    store.last_c[:] = [0, 2, 0]
    # b: 1 − C(6,4)/C(8,4) = 1 − 15/70
    np.testing.assert_allclose(pass_at_k_latest(store, np.arange(3), 4), [0.0, 1 - 15 / 70, 0.5])


def test_uniform_is_an_epoch_without_replacement():
    store = DifficultyStore([f"p{i}" for i in range(10)])
    uniform = registry.build("select", {"name": "uniform"})
    rng = np.random.default_rng(0)
    first = uniform.select(store, 4, rng) + uniform.select(store, 4, rng) + uniform.select(store, 2, rng)
    assert sorted(first) == list(range(10))


def test_rollout_gdro_square_root_rule_tracks_the_mean():
    ids = [f"p{i}" for i in range(40)]
    store = DifficultyStore(ids)
    store.last_n[:] = 8
    store.last_c[:] = np.repeat([0, 2, 4, 6, 8], 8)
    store.alpha[:] = 1 + store.last_c
    store.beta[:] = 1 + 8 - store.last_c
    gdro = registry.build("allocate", {"name": "gdro", "n_mean": 8, "n_min": 2, "n_max": 32})
    problems = [Problem(q, "x") for q in ids]
    for _ in range(30):
        counts = gdro.plan(problems, store, Budget())
    n = np.array([counts.get(q, 0) for q in ids])
    assert abs(n.mean() - 8) < 1.5
    # the bins near p = 0.5 have the largest variance and get the most rollouts
    per_bin = n.reshape(5, 8).mean(1)
    assert per_bin[2] == per_bin.max()


def test_roc_keeps_failures_in_proportion_and_cleanest_successes():
    roc = registry.build("allocate", {"name": "roc", "n": 4})
    g = group("a", [1, 0, 1, 1, 0, 1, 0, 1])
    well_formed = [0, 1, 1, 0, 1, 1, 1, 1]  # one closed <answer> block (format penalty 0) or none (1)
    for r, ok in zip(g.rollouts, well_formed, strict=True):
        r.text = "<answer>5</answer>" if ok else "5"
    out = roc.down_sample(g)
    # |neg| = 3 of 8 → round(3·4/8) = 2 negatives (indices 1, 4: all three well formed, the stable sort keeps
    # the first two), 2 positives with the best format: 2, 5
    assert out.size == 4 and [int(x) for x in out.correct] == [0, 1, 0, 1]
    assert [r.text for r in out.rollouts] == ["<answer>5</answer>"] * 4


def kept_by_stochastic_roc(roc) -> list[int]:
    """Which of 16 rollouts (8 right, 8 wrong, all well formed) a stochastic RoC keeps: the draw alone decides."""
    g = group("a", [1, 0] * 8)
    for i, r in enumerate(g.rollouts):
        r.text = f"<answer>{i}</answer>"
    return [int(r.text[8:-9]) for r in roc.down_sample(g).rollouts]


def test_a_component_seed_left_out_is_the_runs():
    """RoC's stochastic draw, pilot-commit's pilots and polychromic's sets had `seed: 0` whatever the run's seed,
    so the seeds of a comparison drew the same: the run's seed now sets it where the recipe does not."""
    spec = {"name": "roc", "n": 4, "sampling": "stochastic"}
    by_seed = {s: kept_by_stochastic_roc(registry.build("allocate", spec, run_seed=s)) for s in range(6)}
    assert len({tuple(kept) for kept in by_seed.values()}) > 1, by_seed  # (C(8,2)² = 784 ways to keep 2 + 2)
    assert kept_by_stochastic_roc(registry.build("allocate", spec, run_seed=3)) == by_seed[3]  # reproducible
    # set in the recipe: its own, whatever the run's seed
    assert registry.build("allocate", {**spec, "seed": 7}, run_seed=3).seed == 7
    assert registry.build("allocate", {**spec, "seed": 7}, run_seed=4).seed == 7
    # a stream of its own: not the run's seed itself (the trainer's generator draws from that)
    assert registry.build("allocate", spec, run_seed=3).seed != 3
    for stage, name in (("allocate", "pilot_commit"), ("advantage", "polychromic")):
        seeds = {registry.build(stage, {"name": name}, run_seed=s).seed for s in range(4)}
        assert len(seeds) == 4, (name, seeds)
    assert not hasattr(registry.build("allocate", {"name": "fixed"}, run_seed=3), "seed")  # no seed: untouched


# ---------------------------------------------------------------- the store

def test_store_round_trip_and_parquet(tmp_path):
    import pyarrow.parquet as pq

    store = DifficultyStore(["a", "b"])
    store.update([group("a", [1, 0, 1]), group("b", [0, 0])], step=1)
    store.gdro_weights = np.array([0.5, 0.5])
    state = store.state_dict()
    other = DifficultyStore(["a", "b"])
    other.load_state_dict(state)
    for name in ("alpha", "beta", "trials", "reward_m2", "mean_length", "last_step"):
        np.testing.assert_array_equal(getattr(other, name), getattr(store, name))
    assert other.gdro_weights.tolist() == [0.5, 0.5]
    # Welford over rewards (1, 0, 1): mean 2/3, sample variance 1/3
    assert store.reward_mean[0] == pytest.approx(2 / 3)
    assert store.reward_std(np.array([0]))[0] == pytest.approx(math.sqrt(1 / 3))
    table = pq.read_table(store.to_parquet(tmp_path / "store.parquet")).to_pydict()
    assert table["prompt_id"] == ["a", "b"] and table["successes"] == [2, 0]
    with pytest.raises(ValueError, match="different task"):
        DifficultyStore(["x"]).load_state_dict(state)


# ---------------------------------------------------------------- end to end on the tiny model

@pytest.mark.parametrize("select,allocate", [
    ({"name": "gdro", "k": 4}, {"name": "dars", "n": 4, "n_max": 8}),
    ({"name": "vade"}, {"name": "xrpo", "n": 4}),
    ({"name": "curriculum"}, {"name": "dapo", "n": 4, "max_batches": 2}),
])
def test_adaptive_run_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, select, allocate):
    """4 steps straight == 2 steps, checkpoint, a fresh trainer resumes, 2 more: same weights and store."""
    import json

    import torch

    from adarl.config import load_recipe
    from adarl.metrics.step import TIMING_KEYS
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(tmp_path.parent))
    task = write_task(tmp_path)

    def recipe(steps):
        return load_recipe(data=recipe_data(tiny_model_dir, task, select=select, allocate=allocate,
                                            budget={"max_steps": steps, "rollouts_per_step": 20},
                                            checkpoint={"every": 2}, log={"tensorboard": False, "progress": False},
                                            rewards=[{"type": "callable", "function": "e2e_rewards:contains_a"}],
                                            rollout={"temperature": 1.0, "max_new_tokens": 12}))

    straight = Trainer(recipe(4), tmp_path / "straight")
    straight.run()
    first = Trainer(recipe(2), tmp_path / "split")
    first.run()
    second = Trainer(recipe(4), tmp_path / "split")
    second.run(resume=True)
    for (name, a), b in zip(straight.model.named_parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for name in ("alpha", "beta", "reward_m2", "last_step", "mean_length"):
        np.testing.assert_array_equal(getattr(straight.store, name), getattr(second.store, name))

    def rows(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        # the split run's first half ends at step 2, so it evaluates there; the straight run does not
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS and not k.startswith("eval")}
                for x in lines]

    assert rows("straight") == rows("split")
    trained = [r for r in rows("straight") if "reward" in r]
    assert all(r["step_rollouts"] <= 20 for r in trained)
    assert sum(r["trained_groups"] for r in trained) > 0  # something was learned, so equality means something
    assert all("zero_variance_fraction" in r and "effective_token_fraction" in r for r in trained)
    assert (tmp_path / "split" / "store.parquet").is_file()
    prompt_log = [json.loads(x) for x in (tmp_path / "split" / "prompts.jsonl").read_text().splitlines()]
    assert sorted({p["step"] for p in prompt_log}) == [1, 2, 3, 4]


@dataclasses.dataclass
class SeededSelect(Stateless):
    """A plugin selector (named by import path) with a `seed` of its own: every stage gets the run's."""

    seed: int = 0

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        return list(range(k))


def test_the_trainer_gives_its_components_the_runs_seed(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(tmp_path.parent))
    task = write_task(tmp_path)
    built = {}
    for seed in (1, 2):
        recipe = load_recipe(data=recipe_data(tiny_model_dir, task, seed=seed,
                                              allocate={"name": "roc", "n": 4, "sampling": "stochastic"},
                                              advantage={"name": "polychromic"}, log={"progress": False},
                                              select={"name": "test_allocation:SeededSelect"}))
        trainer = Trainer(recipe, tmp_path / f"seed{seed}")
        built[seed] = (trainer.allocator.seed, trainer.estimator.seed, trainer.selector.seed)
    assert built[1] != built[2] and all(s != 0 for pair in built.values() for s in pair), built
    assert built[1][0] == registry.build("allocate", {"name": "roc"}, run_seed=1).seed

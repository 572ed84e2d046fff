"""`adarl compare`: aggregation over seeds on synthetic runs, skip/resume planning, one real tiny comparison."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import adarl.compare as cmp
import adarl.comparison as comparison
import adarl.runs as runs
from adarl.config import dump_recipe, load_recipe
from adarl.stats import mean_ci, t_quantile

# ---------------------------------------------------------------- synthetic runs (also used by test_report)


def synthetic_config(name: str, seed: int, advantage: str = "grpo") -> str:
    data = {
        "name": name, "seed": seed,
        "task": {"source": "reasoning_gym", "name": "basic_arithmetic", "eval_size": 50},
        "advantage": {"name": advantage},
        "loss": {"name": "ppo_clip", "agg": "token-mean" if advantage == "grpo" else "seq-mean-token-sum-norm"},
        "rollout": {"max_new_tokens": 16},  # 1000 tokens buy a step of 8 prompts × 2 rollouts (preflight.check_groups)
        "budget": {"max_steps": None, "max_tokens": 1000},
    }
    return dump_recipe(load_recipe(data=data))


def write_run(run_dir: Path, evals: dict[int, float], *, steps: int, tokens_per_step: int, seed: int = 0,
              name: str = "base", advantage: str = "grpo", finished: bool = True, wall_per_step: float = 2.0,
              prompts: bool = False, eval_json: bool = False) -> Path:
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl (eval rows at `evals` steps)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(synthetic_config(name, seed, advantage))
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps + 1):
        row: dict = {"step": step, "tokens": step * tokens_per_step, "rollouts": step * 32}
        if step:
            progress = step / steps
            row.update({
                "reward": min(1.0, 0.2 + 0.6 * progress + 0.05 * rng.standard_normal()),
                "pass_rate": min(1.0, 0.2 + 0.6 * progress),
                "zero_variance_fraction": 0.6 - 0.3 * progress,
                "entropy": 1.2 - 0.5 * progress + 0.02 * seed,
                "response_length": 12 - 4 * progress,
                "step_tokens": tokens_per_step, "step_rollouts": 32, "groups": 4,
                "wall_s": step * wall_per_step,
            })
        if step in evals:
            row["eval/pass@1"] = evals[step]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if prompts:
        with (run_dir / "prompts.jsonl").open("w") as f:
            for step in range(1, steps + 1):
                for i in range(4):
                    pid = f"p{(step * 3 + i) % 10}"
                    n = 4 + 4 * ((step + i) % 3)
                    correct = int(rng.integers(0, n + 1))
                    lengths = [int(v) for v in rng.integers(4, 20, size=n)]
                    f.write(json.dumps({"step": step, "prompt_id": pid, "n": n, "correct": correct,
                                        "lengths": lengths}) + "\n")
    if eval_json:
        curve = [1 - (1 - 0.3 - 0.05 * seed) ** k for k in range(1, 9)]
        (run_dir / "eval.json").write_text(json.dumps({
            "target": str(run_dir), "n": 8, "k": [1, 2, 4, 8],
            "tasks": {"basic_arithmetic": {"problems": 10, "pass@k_curve": curve,
                                           "pass@k": {str(k): curve[k - 1] for k in (1, 2, 4, 8)}}},
        }))
    if finished:
        (run_dir / "final").mkdir(exist_ok=True)
        (run_dir / "final" / "config.json").write_text("{}")
    return run_dir


def write_comparison(out: Path, prompts: bool = False, eval_json: bool = False) -> Path:
    """Recipe A (3 seeds, 100 tokens/step) and B (2 finished seeds + 1 unfinished, 150 tokens/step)."""
    a = {0: [0.2, 0.4, 0.5], 1: [0.2, 0.6, 0.6], 2: [0.2, 0.5, 0.7]}
    for seed, (p0, p2, p4) in a.items():
        write_run(out / "A" / f"seed{seed}", {0: p0, 2: p2, 4: p4}, steps=4, tokens_per_step=100, seed=seed,
                  name="A", wall_per_step=10.0 + seed, prompts=prompts, eval_json=eval_json)
    b = {0: [0.3, 0.65, 0.7], 1: [0.3, 0.55, 0.8]}
    for seed, (p0, p2, p4) in b.items():
        write_run(out / "B" / f"seed{seed}", {0: p0, 2: p2, 4: p4}, steps=4, tokens_per_step=150, seed=seed,
                  name="B", advantage="drgrpo", wall_per_step=20.0, prompts=prompts, eval_json=eval_json)
    write_run(out / "B" / "seed2", {0: 0.3, 2: 0.99}, steps=2, tokens_per_step=150, seed=2, name="B",
              advantage="drgrpo", finished=False)
    (out / "comparison.json").write_text(json.dumps({"budget_tokens": 400, "recipes": [{"name": "A"},
                                                                                         {"name": "B"}]}))
    return out


# ---------------------------------------------------------------- the t interval


def _t_cdf(t: float, df: int) -> float:
    """Student-t CDF by Simpson's rule on the density (for checking the table)."""
    x = np.linspace(0.0, t, 40001)
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(logc - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    integral = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
    return 0.5 + integral


@pytest.mark.parametrize("df", [*range(1, 31), 35, 50, 120, 1000])
def test_t_quantile_is_the_975_quantile(df):
    # the one t quantile of the codebase (adarl.stats), also used by XRPO's half-width
    assert _t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=2e-5)


def test_mean_ci_by_hand():
    out = mean_ci([0.5, 0.6, 0.7])
    assert out["n"] == 3 and out["mean"] == pytest.approx(0.6) and out["std"] == pytest.approx(0.1)
    half = 4.3027 * 0.1 / math.sqrt(3)  # t(0.975, 2) s / sqrt(n) = 0.24842
    assert out["ci95"] == pytest.approx([0.6 - half, 0.6 + half], abs=1e-4)
    one = mean_ci([0.4])
    assert one["mean"] == 0.4 and one["ci95"] is None
    assert mean_ci([])["mean"] is None


# ---------------------------------------------------------------- aggregation


def test_aggregate_synthetic_comparison(tmp_path):
    # Changed with issue 22: pass@1 is read at the budget (400 tokens), the target is each seed's start + 0.1
    # (not the baseline's final mean), tokens to target interpolate between evals, and B gets paired
    # differences to A.
    result = comparison.aggregate_dir(write_comparison(tmp_path / "cmp"))
    a, b = result["recipes"]
    assert [a["name"], b["name"]] == ["A", "B"] and result["baseline"] == "A"
    assert result["equal_tokens_at"] == 400 and result["budget_tokens"] == 400
    # A: evals at 0, 200, 400 tokens; at 400: 0.5, 0.6, 0.7 -> mean 0.6, s 0.1, half-width t(2) * 0.1 / sqrt(3)
    assert a["finished"] == 3 and a["pass@1_at_budget"]["mean"] == pytest.approx(0.6)
    assert a["pass@1_at_budget"]["ci95"] == pytest.approx([0.6 - 0.248417, 0.6 + 0.248417], abs=1e-5)
    assert a["final_pass@1"]["mean"] == pytest.approx(0.6)
    # B: evals at 0, 300, 600 tokens; seed2 has no final/ and does not count. At 400, a third of the way
    # from 300 to 600: seed0 0.65 + 0.05/3 = 0.66667, seed1 0.55 + 0.25/3 = 0.63333 -> mean 0.65
    assert b["finished"] == 2 and b["seeds"] == [0, 1, 2]
    assert [r["pass@1_at_budget"] for r in b["runs"][:2]] == pytest.approx([0.666667, 0.633333], abs=1e-6)
    assert b["pass@1_at_budget"]["mean"] == pytest.approx(0.65)
    # the final evals (at 600 tokens, past the budget) as before: 0.7, 0.8 -> half-width 12.7062 * 0.0707107 / sqrt(2)
    assert b["final_pass@1"]["ci95"] == pytest.approx([0.75 - 0.63531, 0.75 + 0.63531], abs=1e-5)
    assert [r["status"] for r in b["runs"]] == ["finished", "finished", "incomplete"]
    # AUC over [0, 400] / 400. A seed0: (0.2+0.4)/2*200 + (0.4+0.5)/2*200 = 150 -> 0.375; seed1 200 -> 0.5;
    # seed2 190 -> 0.475. B seed0: (0.3+0.65)/2*300 + (0.65+0.66667)/2*100 = 208.33 -> 0.52083
    assert [r["auc"] for r in a["runs"]] == pytest.approx([0.375, 0.5, 0.475])
    assert a["auc"]["mean"] == pytest.approx(0.45) and b["runs"][0]["auc"] == pytest.approx(0.520833, abs=1e-6)
    # target = each seed's start + 0.1. A (start 0.2 -> 0.3): seed0 crosses between (0, 0.2) and (200, 0.4)
    # at 0.1/0.2*200 = 100; seed1 0.1/0.4*200 = 50; seed2 0.1/0.3*200 = 66.67. B (0.3 -> 0.4): 0.1/0.35*300
    # = 85.71 and 0.1/0.25*300 = 120.
    assert result["target"] == {"pass@1": None, "gain": 0.1, "rule": "each seed's start + 0.1"}
    assert a["tokens_to_target"]["per_seed"] == pytest.approx([100, 50, 66.6667], abs=1e-3)
    assert a["tokens_to_target"]["reached"] == 3 and a["tokens_to_target"]["mean"] == pytest.approx(72.2222, abs=1e-3)
    assert b["tokens_to_target"]["per_seed"] == pytest.approx([85.7143, 120], abs=1e-3)
    # wall time of the last row: A 4 steps x (10, 11, 12) s; tokens 400 and 600
    assert a["wall_s"]["mean"] == pytest.approx(44.0) and b["wall_s"]["mean"] == pytest.approx(80.0)
    assert a["tokens"]["mean"] == 400 and b["tokens"]["mean"] == 600 and b["steps"]["mean"] == 4
    # B - A per seed at 400: 0.16667, 0.03333 -> mean 0.1, s = 0.13333/sqrt(2) = 0.094281,
    # half-width 12.7062 * 0.094281 / sqrt(2) = 0.84708: the interval spans 0, no winner
    vs = b["vs_baseline"]["pass@1_at_budget"]
    assert vs["per_seed"] == pytest.approx({0: 0.166667, 1: 0.033333}, abs=1e-6)
    assert vs["ci95"] == pytest.approx([0.1 - 0.84708, 0.1 + 0.84708], abs=1e-4)
    assert (vs["wins"], vs["losses"], vs["ties"], vs["verdict"]) == (2, 0, 0, "no winner")
    assert a["vs_baseline"] is None

    given = comparison.aggregate_dir(tmp_path / "cmp", target=0.65)
    assert given["target"]["pass@1"] == 0.65 and given["target"]["gain"] is None
    # A seed2 crosses 0.65 between (200, 0.5) and (400, 0.7) at 350; seeds 0, 1 never get there.
    # B seed0 reaches 0.65 at its eval at 300; seed1 crosses at 300 + 0.1/0.25*300 = 420 > 400: not reached
    assert given["recipes"][0]["tokens_to_target"]["per_seed"] == [None, None, pytest.approx(350)]
    assert given["recipes"][0]["tokens_to_target"]["not_reached_seeds"] == [0, 1]
    assert given["recipes"][1]["tokens_to_target"]["per_seed"] == [pytest.approx(300), None]

    header, rows = comparison.summary_rows(result)
    assert rows[0][:5] == ["A", "3/3", "0.600 [0.352, 0.848]", "0.450 [0.286, 0.614]", "72.2 [8.98, 135]"]
    assert rows[1][:3] == ["B", "2/3", "0.650 [0.438, 0.862]"] and rows[1][9] == "ok"
    assert header[2] == "pass@1 at 400 [95% CI]" and header[4] == "tokens to start + 0.1"
    header, rows = comparison.paired_rows(result)
    # Holm: diffs 1/6 and 1/30 give t = 0.1 / (0.0942809 / sqrt 2) = 1.5 on 1 dof, P(T <= t) = 1/2 + atan(1.5)/pi
    # = 0.81283, p = 0.374; one recipe against the baseline is a family of one, so Holm leaves it as it is
    assert rows == [["B", "2", "+0.100 [-0.747, +0.947] 2/0/0", "no winner (interval spans 0)",
                     "p 0.374 → 0.374: not shown", "+0.056 [-1.082, +1.195] 1/1/0", "no winner (interval spans 0)",
                     rows[0][7]]]
    assert rows[0][7].endswith(": not shown") and header[4] == "Holm"
    header, rows = comparison.seed_rows(result)
    assert rows[0][3] == "0.500 [0.366, 0.634]" and rows[0][4] == "50"  # Wilson on the 50 held-out problems

    other = comparison.aggregate_dir(tmp_path / "cmp", baseline="B")
    assert other["baseline"] == "B" and other["recipes"][1]["vs_baseline"] is None
    assert other["recipes"][0]["vs_baseline"]["pass@1_at_budget"]["mean"] == pytest.approx(-0.1)


def test_a_seed_at_or_above_a_given_target_reaches_it_at_its_start(tmp_path):
    # target 0.25: B's seeds start at 0.3, so they reach it at their first eval (0 tokens, "at start");
    # A's start at 0.2 and cross at 0.05/0.2*200 = 50, 0.05/0.4*200 = 25, 0.05/0.3*200 = 33.3
    result = comparison.aggregate_dir(write_comparison(tmp_path / "cmp"), target=0.25)
    a, b = result["recipes"]
    assert b["tokens_to_target"]["per_seed"] == [0.0, 0.0] and b["tokens_to_target"]["reached"] == 2
    assert a["tokens_to_target"]["per_seed"] == pytest.approx([50, 25, 33.333], abs=1e-3)
    rows = comparison.seed_rows(result)[1]
    assert rows[3][7] == "0 (at start)" and rows[0][7] == "50"


def test_unreached_seeds_are_counted_not_averaged(tmp_path):
    # target 0.75: no A seed gets there by 400 tokens (best 0.7); B seed1 only at 600 tokens, past the budget
    result = comparison.aggregate_dir(write_comparison(tmp_path / "cmp"), target=0.75)
    a, b = result["recipes"]
    assert a["tokens_to_target"]["per_seed"] == [None, None, None] and a["tokens_to_target"]["mean"] is None
    assert comparison.fmt_to_target(a["tokens_to_target"]) == "not reached (0/3 seeds)"
    assert b["tokens_to_target"]["not_reached_seeds"] == [0, 1]
    assert all(row[7] == "not reached" for row in comparison.seed_rows(result)[1] if row[2] == "finished")


def test_find_runs_keeps_the_comparison_order(tmp_path):
    out = write_comparison(tmp_path / "cmp")
    (out / "comparison.json").write_text(json.dumps({"recipes": [{"name": "B"}, {"name": "A"}]}))
    found = runs.find_runs(out)
    assert list(found) == ["B", "A"] and [s for s, _ in found["B"]] == [0, 1, 2]


# ---------------------------------------------------------------- planning, skipping, resuming


def _recipe_file(tmp_path: Path, name: str, advantage: str = "grpo") -> Path:
    path = tmp_path / f"{name}.yaml"
    data = yaml.safe_load(synthetic_config(name, 0, advantage))
    data["budget"] = {"max_steps": 30, "prompts_per_step": 2}  # a 100-token budget buys a step of pairs
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_sets_seed_and_token_budget(tmp_path):
    jobs = cmp.plan([_recipe_file(tmp_path, "a"), _recipe_file(tmp_path, "b", "drgrpo")], range(2), 5000,
                    tmp_path / "out", ["eval.every=2"])
    assert [(j.name, j.seed, j.run_dir.relative_to(tmp_path / "out").as_posix()) for j in jobs] == [
        ("a", 0, "a/seed0"), ("a", 1, "a/seed1"), ("b", 0, "b/seed0"), ("b", 1, "b/seed1")]
    # every run evaluates at the same 10 token points (5000 / 10 = 500 apart); the user's eval.every=2 comes after
    assert jobs[1].overrides == ["seed=1", "eval.every_tokens=500", "eval.every=0", "eval.every=2",
                                 "budget.max_tokens=5000", "budget.max_steps=null"]
    recipe = load_recipe(jobs[1].recipe, jobs[1].overrides)  # what the run will train with
    assert recipe.seed == 1 and recipe.budget.max_tokens == 5000 and recipe.budget.max_steps is None
    assert recipe.eval.every_tokens == 500 and recipe.eval.every == 2
    steps = cmp.plan([_recipe_file(tmp_path, "a")], range(1), 5000, tmp_path / "out", [], eval_points=0)
    assert steps[0].overrides == ["seed=0", "budget.max_tokens=5000", "budget.max_steps=null"]  # the recipe's own


def test_plan_refuses_recipes_on_different_held_out_sets(tmp_path):
    from adarl.config import RecipeError

    a, b = _recipe_file(tmp_path, "a"), _recipe_file(tmp_path, "b", "drgrpo")
    data = yaml.safe_load(b.read_text())
    data["task"]["data_seed"] = 7
    b.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"different task.data_seed values \(\[0, 7\]\)"):
        cmp.plan([a, b], range(2), 5000, tmp_path / "out")
    jobs = cmp.plan([a, b], range(2), 5000, tmp_path / "out", ["task.data_seed=3"])  # one for all: fine
    assert {load_recipe(j.recipe, j.overrides).task.data_seed for j in jobs} == {3}


def test_baseline_by_name_or_path(tmp_path):
    names, paths = ["a", "b"], [str(tmp_path / "a.yaml"), str(tmp_path / "x" / "b.yaml")]
    assert comparison.pick_baseline(names, None, paths) == "a"
    assert comparison.pick_baseline(names, "b", paths) == "b"
    assert comparison.pick_baseline(names, str(tmp_path / "x" / "b.yaml"), paths) == "b"
    with pytest.raises(ValueError, match=r"--baseline c: not one of the recipes \(a, b\)"):
        comparison.pick_baseline(names, "c", paths)


def test_plan_gives_same_named_recipes_distinct_dirs(tmp_path):
    (tmp_path / "x").mkdir()
    first = _recipe_file(tmp_path, "same")
    second = tmp_path / "x" / "other.yaml"
    second.write_text(first.read_text())
    jobs = cmp.plan([first, second], [0], 100, tmp_path / "out")
    assert [j.name for j in jobs] == ["same", "other"]


def test_rerun_skips_finished_resumes_checkpointed_restarts_the_rest(tmp_path):
    recipe = _recipe_file(tmp_path, "a")
    jobs = cmp.plan([recipe], range(4), 500, tmp_path / "out")
    done, ckpt, crashed, fresh = (j.run_dir for j in jobs)
    write_run(done, {0: 0.1, 2: 0.3}, steps=2, tokens_per_step=250)
    write_run(ckpt, {0: 0.1}, steps=1, tokens_per_step=250, finished=False)
    (ckpt / "checkpoints" / "step_000001").mkdir(parents=True)
    for name in ("weights.safetensors", "optimizer.pt", "state.pt"):  # what makes a checkpoint complete
        (ckpt / "checkpoints" / "step_000001" / name).write_bytes(b"x")
    write_run(crashed, {0: 0.1}, steps=1, tokens_per_step=250, finished=False)  # died before a checkpoint
    (crashed / "train.log").write_text("first attempt\n")

    calls = []

    def runner(command, log, cwd, env):
        calls.append(command)
        run_dir = Path(command[command.index("--resume") + 1] if "--resume" in command else command[-1])
        if run_dir == fresh:
            return 1  # a crash of one run does not stop the others
        write_run(run_dir, {0: 0.1, 2: 0.4}, steps=2, tokens_per_step=250)
        return 0

    lines = []
    status = cmp.run_jobs(jobs, echo=lines.append, runner=runner)
    assert status == {done: "skipped", ckpt: "resumed", crashed: "finished", fresh: "failed (1)"}
    assert len(calls) == 3
    assert calls[0][-3:] == ["train", "--resume", str(ckpt)]
    assert calls[1][-9:] == ["train", str(recipe), "seed=2", "eval.every_tokens=50", "eval.every=0",
                             "budget.max_tokens=500", "budget.max_steps=null", "--run-dir", str(crashed)]
    assert (crashed / "train.log").read_text() == "first attempt\n"  # the log survives the restart
    assert any("skipped" in line for line in lines) and any("FAILED" in line for line in lines)
    # a run finished in this invocation loses its checkpoints (3x the model); final/ and the metrics stay
    assert not (ckpt / "checkpoints").exists() and (ckpt / "final").is_dir() and (ckpt / "metrics.jsonl").exists()
    assert any("deleted checkpoints/" in line for line in lines)


def test_keep_checkpoints_keeps_them(tmp_path):
    jobs = cmp.plan([_recipe_file(tmp_path, "a")], [0], 500, tmp_path / "out")

    def runner(command, log, cwd, env):
        run_dir = Path(command[-1])
        write_run(run_dir, {0: 0.1, 2: 0.4}, steps=2, tokens_per_step=250)
        (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_000002" / "optimizer.pt").write_bytes(b"x" * 1000)
        return 0

    assert cmp.run_jobs(jobs, echo=lambda _: None, runner=runner, keep_checkpoints=True) == {
        jobs[0].run_dir: "finished"}
    assert (jobs[0].run_dir / "checkpoints" / "step_000002" / "optimizer.pt").stat().st_size == 1000
    assert cmp.drop_checkpoints(jobs[0].run_dir) == 1000 and not (jobs[0].run_dir / "checkpoints").exists()


# ---------------------------------------------------------------- a real comparison on the tiny model


def _cli_compare(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`adarl compare ARGS` as a user runs it: its own process, 200 columns so no table title wraps."""
    tests = Path(__file__).parents[1]  # the helpers recipes name (e2e_rewards, ...)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "adarl.cli", "compare", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_compare_end_to_end_on_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    """`adarl compare` on two recipes, one seed, a 150-token budget, to its last line; a rerun skips the runs."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_train import recipe_data, write_task

    task = write_task(tmp_path)
    paths = []
    for name, adv, agg in (("grpo", "grpo", "token-mean"), ("drgrpo", "drgrpo", "seq-mean-token-sum-norm")):
        data = recipe_data(tiny_model_dir, task, name=name, advantage={"name": adv},
                           loss={"name": "ppo_clip", "agg": agg}, eval={"every": 1, "at_start": True},
                           log={"tensorboard": False, "progress": False}, checkpoint={"every": 0})
        data["budget"] = {"max_steps": 3, "prompts_per_step": 2}
        data["allocate"] = {"name": "fixed", "n": 4}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        paths.append(tmp_path / f"{name}.yaml")
    out = tmp_path / "cmp"
    args = [*map(str, paths), "--budget-tokens", "150", "--seeds", "1", "--out", str(out)]
    proc = _cli_compare(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = proc.stdout
    # the four tables (titles, then a row per recipe), the notes, and the two files, in that order
    titles = ["comparison at 150 generated tokens", "against the baseline grpo (same seed, same held-out problems)",
              "mechanism (mean over seeds)", "per run", "pass@1 at B:", f"wrote {out / 'comparison.json'}",
              f"wrote {out / 'report.html'}"]
    at = [said.index(t) for t in titles]
    assert at == sorted(at), said
    assert said.rstrip().endswith(f"wrote {out / 'report.html'}"), said
    per_recipe = said[at[0]:at[1]]
    assert "│ grpo " in per_recipe and "│ drgrpo " in per_recipe and "1/1" in per_recipe, said
    assert "│ drgrpo " in said[at[1]:at[2]] and "│ grpo " not in said[at[1]:at[2]], said  # only the non-baseline
    assert "│ grpo " in said[at[2]:at[3]] and "│ drgrpo " in said[at[2]:at[3]], said  # the mechanism, per recipe
    assert said[at[3]:at[4]].count(" finished ") == 2, said

    saved = json.loads((out / "comparison.json").read_text())
    assert [r["name"] for r in saved["recipes"]] == ["grpo", "drgrpo"]
    for rec in saved["recipes"]:
        run = rec["runs"][0]
        assert run["status"] == "finished", (out / rec["name"] / "seed0" / "train.log").read_text()
        rows = runs.read_metrics(Path(run["dir"]))
        last = rows[-1]
        # stopped by the token budget (max_steps is null), never past it: steps of up to 2 prompts x 4 x 8 = 64
        # tokens leave 150 - 2 x 64 = 22 or more for a third, trimmed to what is left
        assert last["tokens"] <= 150 and last["step"] >= 3 and rows[-1]["step_tokens"] < 64
        assert "eval/pass@1" in last and rec["final_pass@1"]["n"] == 1
        config = yaml.safe_load((Path(run["dir"]) / "config.yaml").read_text())
        assert config["budget"]["max_steps"] is None and config["budget"]["max_tokens"] == 150
        assert (Path(run["dir"]) / "final").is_dir() and not (Path(run["dir"]) / "checkpoints").exists()
    # changed with issue 22: the default target is each seed's start + 0.1, not the baseline's final mean
    assert saved["budget_tokens"] == 150 and saved["target"]["gain"] == 0.1 and saved["baseline"] == "grpo"
    assert saved["equal_tokens_at"] == 150 and saved["recipes"][1]["vs_baseline"]["pass@1_at_budget"]["n"] == 1

    text = (out / "report.html").read_text()
    # 7 curve panels (no eval JSON; the useful-token fraction among them, not the unseen fraction: every prompt
    # chosen here is new, so it never moves and the report leaves its flat line out) + the prompt × step heat
    # maps (pass rate, rollouts) from prompts.jsonl
    assert text.count('src="data:image/png;base64,') == 9 and "Unseen fraction of the selected" not in text
    assert "<td>grpo</td><td>1/1</td>" in text and "<td>drgrpo</td><td>1/1</td>" in text

    mtime = (out / "grpo" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = _cli_compare([*args, "--no-report"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("finished before, skipped") == 2 and "report.html" not in again.stdout
    assert (out / "grpo" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == mtime
    assert json.loads((out / "comparison.json").read_text())["recipes"][0]["final_pass@1"] == \
        saved["recipes"][0]["final_pass@1"]


def test_cli_compare_checks_recipes_and_ray_before_running(tmp_path):
    from typer.testing import CliRunner

    from adarl.cli import app

    recipe = _recipe_file(tmp_path, "a")
    bad = CliRunner().invoke(app, ["compare", str(recipe), "--budget-tokens", "100", "--set", "rollout.temprature=1",
                                   "--out", str(tmp_path / "out")])
    assert bad.exit_code == 2 and "temperature" in bad.output and not (tmp_path / "out").exists()
    unknown = CliRunner().invoke(app, ["compare", str(recipe), "--budget-tokens", "100", "--baseline", "b",
                                       "--out", str(tmp_path / "out")])
    assert unknown.exit_code == 2 and "--baseline b: not one of the recipes (a)" in unknown.output
    assert not (tmp_path / "out").exists()
    try:
        import ray  # noqa: F401
    except ImportError:
        result = CliRunner().invoke(app, ["compare", str(recipe), "--budget-tokens", "100", "--ray", "auto",
                                          "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and "ray" in result.output and not (tmp_path / "out").exists()


@pytest.mark.heavy
def test_runs_as_ray_tasks(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'adarl[ray]')")
    jobs = cmp.plan([_recipe_file(tmp_path, "a")], range(2), 500, tmp_path / "out")
    script = ("import pathlib, sys; d = pathlib.Path(sys.argv[-1]); (d / 'final').mkdir(parents=True); "
              "(d / 'metrics.jsonl').write_text('{\"step\": 0, \"tokens\": 0, \"eval/pass@1\": 0.5}\\n')")
    monkeypatch.setattr(cmp, "command", lambda job, state: [sys.executable, "-c", script, str(job.run_dir)])
    try:
        status = cmp.run_jobs(jobs, echo=lambda _: None, ray_address="local")
    finally:
        ray.shutdown()
    assert status == {j.run_dir: "finished" for j in jobs}

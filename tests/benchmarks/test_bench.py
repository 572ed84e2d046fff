"""The benchmarks run to their end at their smallest setting (times mean nothing here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adarl.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_vs_trl_smoke_runs_both_trainers_on_the_same_prompts(tiny_model_dir, tmp_path):
    """bench/vs_trl.py --smoke: 2 steps of 2 prompts × 2 completions each side, on the tiny model."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]')")
    out = tmp_path / "vs_trl.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--smoke", "--model", str(tiny_model_dir),
                           "--threads", "1", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith(f"wrote {out}"), proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["steps"] == 2 and result["config"]["model"] == str(tiny_model_dir)
    for side in ("adarl", "trl"):
        assert len(result[side]["step_s"]) == 2, side
        # 2 prompts × 2 completions of at most 8 tokens a step
        assert all(0 < tokens <= 32 for tokens in result[side]["step_tokens"]), result[side]["step_tokens"]
    assert result["same_prompts"] is True  # TRL generated from the token ids adarl did
    assert result["ratio_step_time"] > 0 and result["versions"]["trl"] == "1.16.0"


# bench/allocation.py's method table as the committed results (bench/results/allocation, ladder, branching)
# were produced with, before the methods moved into recipes/
LEGACY_METHODS = {
    "uniform": [],
    "vade": ["select.name=vade"],
    "curriculum": ["select.name=curriculum"],
    "gdro": ["select.name=gdro", "allocate={name: gdro, n_mean: 8}"],
    "dapo": ["allocate={name: dapo, n: 8, max_batches: 3}"],
    "dars": ["allocate={name: dars, n: 8, n_max: 24, schedule: hardness}", "advantage.name=drgrpo"],
    "xrpo": ["allocate={name: xrpo, n: 8}"],
    "roc": ["allocate={name: roc, n: 8, oversample: 2.0}"],
    "brorl": ["allocate={name: brorl, n: 32}", "budget.prompts_per_step=2"],
    "vade+dars": ["select.name=vade", "allocate={name: dars, n: 8, n_max: 24}", "advantage.name=drgrpo"],
    "pilot_commit": ["allocate={name: pilot_commit, pilot_n: 2, commit_n: 6}"],
    "eptree": ["rollout.branching={policy: eptree, roots: 1, top_n: 2, children: 2}"],
    "latr": ["rollout.branching={policy: latr}"],
    "treepo": ["rollout.branching={policy: treepo, width: 2, segment: 4, max_depth: 6}", "advantage={name: treepo}"],
    "guide": ["hints={name: guide, source: solution}"],
    "seele": ["hints={name: seele, source: solution}"],
    "adhint": ["hints={name: adhint, source: solution}", "advantage={name: adhint}"],
    "xrpo_seeding": ["hints={name: xrpo, k: 2}"],
    "sdar": ["distill={method: sdar, teacher: policy, context: solution}"],
}


@pytest.mark.parametrize("method", sorted(LEGACY_METHODS))
def test_a_benchmark_method_is_its_recipe_and_the_table_it_replaced(method, monkeypatch):
    """bench/methods.py reads each method from its recipe: on the quickstart, the recipe's sections resolve to
    the same recipe as the old private table did, so the committed results stay reproducible."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from methods import METHODS, RECIPES

    assert set(LEGACY_METHODS) <= set(METHODS) and (ROOT / "recipes" / f"{RECIPES[method]}.yaml").is_file()
    base = ROOT / "recipes" / "quickstart.yaml"
    new, old = load_recipe(base, METHODS[method]), load_recipe(base, LEGACY_METHODS[method])
    assert new.model_dump() == old.model_dump()


def test_agent_bench_takes_a_recipe_reuses_kept_runs_and_pairs_the_seeds(tmp_path, monkeypatch, capsys):
    """bench/agent.py --recipe: kept result files are not redone (no model loads here), the table pairs
    SFT + RL with SFT and with RL without tools by seed, and --sft-seed shares one cold start's result."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_agent", ROOT / "bench" / "agent.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = tmp_path / "results"
    kept = {("sft", 0): 0.2, ("sft_rl", 0): 0.5, ("sft_rl", 1): 0.6, ("rl_no_tools", 0): 0.0, ("rl_no_tools", 1): 0.1}
    for (condition, seed), value in kept.items():
        (results / condition / f"seed{seed}").mkdir(parents=True)
        (results / condition / f"seed{seed}" / "result.json").write_text(json.dumps({"pass@1": value}))
    monkeypatch.setattr(bench, "run_sft", lambda *a, **k: pytest.fail("a kept run was redone"))
    monkeypatch.setattr(bench, "Trainer", lambda *a, **k: pytest.fail("a kept run was redone"))
    monkeypatch.setattr(bench, "held_out", lambda *a, **k: pytest.fail("a kept run was redone"))
    out = bench.main(["--recipe", str(ROOT / "recipes" / "agent_text_to_sql.yaml"), "--task-name", "text_to_sql",
                      "--seeds", "0,1", "--conditions", "sft,sft_rl,rl_no_tools", "--sft-seed", "0",
                      "--results", str(results), "--runs", str(tmp_path / "runs")])
    assert out["table"] == {"sft": {0: 0.2, 1: 0.2}, "sft_rl": {0: 0.5, 1: 0.6}, "rl_no_tools": {0: 0.0, 1: 0.1}}
    assert json.loads((results / "sft" / "seed1" / "result.json").read_text()) == {"pass@1": 0.2, "shared_from_seed": 0}
    rl_vs_sft, rl_vs_no_tools = out["paired"]
    assert (rl_vs_sft["a"], rl_vs_sft["b"]) == ("sft_rl", "sft")
    assert rl_vs_sft["per_seed"] == pytest.approx({0: 0.3, 1: 0.4}) and rl_vs_sft["mean"] == pytest.approx(0.35)
    assert rl_vs_no_tools["per_seed"] == pytest.approx({0: 0.5, 1: 0.5}) and rl_vs_no_tools["wins"] == 2
    printed = capsys.readouterr().out
    assert "| sft_rl − sft | 2 | +0.300, +0.400 | +0.350 [" in printed


def test_campaign_smoke_runs_each_method_and_tabulates_the_mechanism(tiny_model_dir, tmp_path):
    """bench/campaign.py --smoke: the mixed pool cut to 1 problem a share (3 in all), 2 prompts of at most
    8-token completions a step, 320 tokens: about 3 steps, so the budget passes over the pool more than once
    and the selectors come back to prompts they have seen; kept runs are then tabulated without training."""
    out, results = tmp_path / "campaign.json", tmp_path / "results"
    command = [sys.executable, str(ROOT / "bench" / "campaign.py"), "--smoke", "--model", str(tiny_model_dir),
               "--methods", "uniform,feature_prior", "--seeds", "0,1", "--threads", "1",
               "--runs", str(tmp_path / "runs"), "--results", str(results), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mixed = json.loads(out.read_text())["pools"]["mixed"]
    kept = sorted(results.glob("mixed/*/*/seed*/metrics.jsonl"))
    assert [p.parent.parent.name for p in kept] == ["feature_prior"] * 2 + ["uniform"] * 2
    for path in kept:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        trained = [r for r in rows if r["step"] > 0]
        assert rows[-1]["tokens"] <= 320 and "eval/pass@1/hard" in rows[-1]
        # passes over the pool: every group is one visit of one of the 3 problems
        passes = sum(r["groups"] for r in trained) / 3
        assert passes > 1 and trained[-1]["pool/visited_fraction"] == 1.0
        # the kept groups are the run's: one line per group sampled
        assert len((path.parent / "prompts.jsonl").read_text().splitlines()) == sum(r["groups"] for r in trained)
    for row in mixed["mechanism"]:
        assert row["seeds"] == 2 and row["passes"] > 1
        assert {"final pass@1 easy", "final pass@1 middle", "final pass@1 hard"} <= set(row)
        # step 1 draws only unseen prompts, a later step some seen ones: the run's mean lies strictly between
        assert 0 < row["unseen fraction"] < 1 and row["visits per selected prompt"] > 0
        assert row["useful-token fraction"] + row["wasted token fraction"] <= 1 + 1e-9
    for row in mixed["shares"]:  # each share's fraction of the groups: 1 problem of 3 each, they add up to 1
        assert sum(row[share]["groups"] for share in ("easy", "middle", "hard")) == pytest.approx(1.0)
    # the tiny model scores 0 from its first eval (tokens 0) on: every seed reaches uniform's final 0 at once
    assert [(r["method"], r["per_seed"], r["mean"]) for r in mixed["tokens_ratio"]] == [
        ("uniform", {"0": 0.0, "1": 0.0}, 0.0), ("feature_prior", {"0": 0.0, "1": 0.0}, 0.0)]
    (paired,) = mixed["paired"]
    assert paired["method"] == "feature_prior" and paired["pass@1_at_budget"]["n"] == 2
    # the kept results are the runs: --report-only trains nothing and gives the same table
    again = subprocess.run([*command, "--report-only", "--runs", str(tmp_path / "no-runs")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "seed 0" not in again.stdout.split("###")[0], again.stdout + again.stderr
    assert json.loads(out.read_text())["pools"]["mixed"]["mechanism"] == mixed["mechanism"]
    assert "| feature_prior | 2 | " in again.stdout and "final pass@1 easy | final pass@1 middle" in again.stdout


def test_campaign_teacher_adds_on_policy_distillation(tiny_model_dir, tmp_path):
    """bench/campaign.py --teacher: methods `opd` and `aopd` train with the teacher's per-token log-probs (its
    forward tokens are counted), and without --teacher there are no such methods."""
    command = [sys.executable, str(ROOT / "bench" / "campaign.py"), "--smoke", "--model", str(tiny_model_dir),
               "--methods", "opd,aopd", "--seeds", "0", "--threads", "1", "--runs", str(tmp_path / "runs"),
               "--results", str(tmp_path / "results")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    refused = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "unknown method/pool ['opd', 'aopd']" in refused.stderr
    proc = subprocess.run([*command, "--teacher", str(tiny_model_dir)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for method in ("opd", "aopd"):
        (kept,) = (tmp_path / "results").glob(f"mixed/*/{method}/seed0/metrics.jsonl")
        rows = [json.loads(line) for line in kept.read_text().splitlines() if json.loads(line)["step"] > 0]
        assert rows and all(r["distill/teacher_forward_tokens"] > 0 for r in rows), method
        (config,) = (tmp_path / "runs").glob(f"mixed/*/{method}/seed0/config.yaml")
        assert load_recipe(config).distill.method == method


def test_attention_bench_smoke_times_both_paths_and_they_agree(tmp_path):
    """bench/attention.py --smoke: one decode step of a 2-layer grouped-query model both ways; the logits agree."""
    out = tmp_path / "attention.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "attention.py"), "--smoke", "--threads", "1",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["rows"] == 2 and result["sdpa_s"] > 0 and result["grouped_s"] > 0
    assert result["max_abs_logit_diff"] < 1e-4


def test_prior_calibration_replays_the_kept_runs(tmp_path):
    """bench/prior_calibration.py on the committed large-pool runs of one seed: the constant prediction's
    Brier score is the mean of (1/2 − c/n)² over every group after the first step, computed here from the file;
    the selector's fitted prior must beat it on the groups of a run that selected as uniform does (VADE)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from equal_budget import read_kept

    kept = read_kept(ROOT / "bench/results/campaign/mixed/n400-e40-b12000/vade/seed0/prompts.jsonl")
    assert kept is not None, "the committed large-pool run of VADE seed 0 is gone"
    groups = [json.loads(x) for x in kept.splitlines()]
    later = [g for g in groups if g["step"] > min(x["step"] for x in groups)]
    expected = sum((0.5 - g["correct"] / g["n"]) ** 2 for g in later) / len(later)
    out = tmp_path / "calibration.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prior_calibration.py"), "--methods", "vade",
                           "--seeds", "0", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["replays"]["vade"]
    assert rows["constant 1/2"]["groups"] == len(later)
    assert rows["constant 1/2"]["brier"] == pytest.approx(expected)
    assert rows["constant 1/2"]["loglik"] == pytest.approx(-0.6931, abs=1e-4)  # log 1/2, whatever was sampled
    assert rows["posterior mean (s=0)"]["brier"] < expected


def test_campaign_teacher_data_holds_no_held_out_problem(tmp_path):
    """bench/campaign.py --teacher-data: a wider cut of the mixed pool shares problems with the campaign's
    held-out set (the split depends on the cut), and the teacher's SFT data must hold none of them; read back
    as a jsonl task, its held-out set is the campaign's, problem for problem."""
    from adarl.tasks import build_task

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "campaign.py"), "--pools", "mixed",
                           "--teacher-data", str(tmp_path), "--teacher-pool-size", "60"],
                          cwd=ROOT / "bench", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {name: [json.loads(x) for x in (tmp_path / "mixed" / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "heldout")}
    mixture = [s.model_dump() for s in load_recipe(ROOT / "recipes" / "mixed_pool.yaml").task.mixture]
    campaign = load_recipe(ROOT / "recipes" / "mixed_pool.yaml", [
        "task.mixture=" + json.dumps([{**s, "size": 6, "eval_size": 40} for s in mixture])])
    held = build_task(campaign.task).eval
    wide = build_task(load_recipe(ROOT / "recipes" / "mixed_pool.yaml", [
        "task.mixture=" + json.dumps([{**s, "size": 60, "eval_size": 40} for s in mixture])]).task)
    questions = {p.messages[-1]["content"] for p in held}
    assert [r["id"] for r in rows["heldout"]] == [p.id for p in held]
    assert not questions & {r["prompt"][-1]["content"] for r in rows["train"]}
    overlap = [p for p in wide.train + wide.eval if p.messages[-1]["content"] in questions]
    assert overlap  # the wider cut does hold some of them, so something was left out
    assert len(rows["train"]) == len(wide.train) + len(wide.eval) - len(overlap)
    assert {r["share"] for r in rows["train"]} == {"easy", "middle", "hard"}
    task = build_task(load_recipe(ROOT / "recipes" / "mixed_pool.yaml", [
        "task.source=jsonl", "task.mixture=null", f"task.path={tmp_path / 'mixed' / 'train.jsonl'}",
        f"task.eval_path={tmp_path / 'mixed' / 'heldout.jsonl'}", "task.eval_size=120"]).task)
    assert [p.id for p in task.eval] == [p.id for p in held] and len(task.train) == len(rows["train"])

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

    assert set(METHODS) == set(LEGACY_METHODS) and (ROOT / "recipes" / f"{RECIPES[method]}.yaml").is_file()
    base = ROOT / "recipes" / "quickstart.yaml"
    new, old = load_recipe(base, METHODS[method]), load_recipe(base, LEGACY_METHODS[method])
    assert new.model_dump() == old.model_dump()

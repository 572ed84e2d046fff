"""bench/gpu_campaign.py: the pre-registered GPU campaign's problems, analysis and command (smallest setting)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_campaign  # noqa: E402
from gpu_campaign import DESIGN, analyse, at_points, auc  # noqa: E402


def test_the_design_is_the_pre_registered_one() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("## bench/gpu_campaign.py (pre-registered, issue 49)")[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    registered = yaml.safe_load(block)
    assert {**registered, "shares": {k: tuple(v) for k, v in registered["shares"].items()}} == DESIGN


@pytest.mark.parametrize("kind", ["quickstart", "campaign"])
def test_the_carried_problems_are_the_ones_the_recipes_build(kind: str, tmp_path: Path) -> None:
    """The GPU machine has no reasoning-gym: its runs read the committed jsonl files. They hold the same problems
    (ids, chat prompts, answers, columns, order) as the reasoning-gym recipes, and the committed files are the
    ones `--write-pools` writes today."""
    from adarl.config import load_recipe
    from adarl.tasks import build_task

    recipe = gpu_campaign.recipe_of(kind)
    built = build_task(load_recipe(recipe, gpu_campaign.source_overrides(kind)).task)
    read = build_task(load_recipe(recipe, gpu_campaign.jsonl_overrides(kind)).task)

    def key(problems):
        return [(p.id, json.dumps(p.prompt), p.answer, json.dumps(p.columns, sort_keys=True)) for p in problems]

    assert key(read.train) == key(built.train) and key(read.eval) == key(built.eval)
    sizes = {"quickstart": (2000, 100), "campaign": (200, 400)}[kind]
    assert (len(read.train), len(read.eval)) == sizes
    if kind == "campaign":
        shares = [p.columns["share"] for p in read.eval]
        assert {s: shares.count(s) for s in set(shares)} == {k: v[1] for k, v in DESIGN["shares"].items()}
        assert not {p.id for p in read.train} & {p.id for p in read.eval}
    gpu_campaign.write_pools(tmp_path)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / kind / name).read_bytes() == (gpu_campaign.POOLS / kind / name).read_bytes()


def evals(*points: tuple[int, float]) -> list[dict]:
    return [{"step": i, "tokens": t, **({"eval/pass@1": a} if a is not None else {})}
            for i, (t, a) in enumerate(points)]


def test_values_are_read_at_fixed_token_points() -> None:
    rows = evals((0, 0.1), (60, None), (120, 0.2), (190, None), (250, 0.4), (290, 0.5))
    # the evaluation made for each point is the first at or after it; a finished run's last one is its budget's
    assert at_points(rows, 100, 300, finished=True) == {0: 0.1, 100: 0.2, 200: 0.4, 300: 0.5}
    assert at_points(rows, 100, 300, finished=False) == {0: 0.1, 100: 0.2, 200: 0.4}  # stopped short of 300
    # trapezoid over 0..200 by hand: (100 (0.1 + 0.2) / 2 + 100 (0.2 + 0.4) / 2) / 200 = 0.225
    assert auc({0: 0.1, 100: 0.2, 200: 0.4}, 200) == pytest.approx(0.225)
    assert auc({0: 0.1, 100: 0.2}, 200) is None  # never reached the point: no area


def test_the_analysis_is_paired_at_the_common_point_and_holm_corrected() -> None:
    design = {**DESIGN, "arms": ["uniform", "a", "b"], "seeds": [0, 1, 2], "budget_tokens": 200,
              "eval_every_tokens": 100, "min_confirmatory_tokens": 100}
    base = {0: 0.30, 1: 0.40, 2: 0.50}
    gain = {"a": [0.10, 0.20, 0.30], "b": [0.00, 0.00, 0.00]}
    runs = {}
    for s in range(3):
        runs[f"uniform/seed{s}"] = {"status": "done", "rows": evals((0, 0.0), (110, base[s]), (200, base[s]))}
        for arm in ("a", "b"):
            # a and b stopped before 200: the point of analysis falls to 100
            runs[f"{arm}/seed{s}"] = {"status": "stopped",
                                      "rows": evals((0, 0.0), (105, base[s] + gain[arm][s]), (150, None))}
    result = analyse(runs, design)
    assert result["point"] == 100 and result["seeds"] == [0, 1, 2] and result["confirmatory"]
    a = result["contrasts"]["a"]["pass@1"]
    assert a["mean"] == pytest.approx(0.2) and a["wins"] == 3
    # diffs 0.1, 0.2, 0.3: t = 0.2 / (0.1 / sqrt 3) = 3.4641 on 2 dof; P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2))
    # = 0.96291, so p = 0.07418; Holm over {a: 0.07418, b: 1}: a first, times 2 = 0.14837
    assert a["p"] == pytest.approx(0.07418, abs=1e-4)
    assert a["holm_p"] == pytest.approx(0.14837, abs=2e-4) and a["holm_verdict"] == "keep"
    assert result["contrasts"]["b"]["pass@1"]["holm_p"] == 1.0
    # the AUC to 100 by hand: (0 + v) / 2, so its paired differences are half of pass@1's
    assert result["contrasts"]["a"]["auc"]["mean"] == pytest.approx(0.1)


@pytest.mark.model
def test_the_campaign_command_runs_at_its_smallest_setting(tmp_path: Path) -> None:
    """The command the GPU machine runs, on the CPU with the tests' tiny model: the quickstart, then every arm of
    two seeds at once; each run evaluates where its sampled tokens first reach a multiple of eval.every_tokens,
    and the report reads them at the same points."""
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "gpu_campaign.py"), "--smoke", "--device", "cpu",
               "--tiny", str(tmp_path / "tiny"), "--out", str(out), "--runs", str(tmp_path / "runs"),
               "--deadline-s", "400"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    quick = json.loads((out / "quickstart.json").read_text())["quickstart"]
    assert quick["status"] == "done" and [r["step"] for r in quick["rows"]] == [0, 1, 2]
    runs = json.loads(gzip.decompress((out / "runs.json.gz").read_bytes()))
    design = json.loads((out / "card.json").read_text())["design"]
    assert sorted(runs) == sorted(f"{a}/seed{s}" for a in DESIGN["arms"] for s in design["seeds"])
    every = design["eval_every_tokens"]
    for name, run in runs.items():
        assert run["status"] == "done", (name, run.get("log_tail"))
        tokens = [r["tokens"] for r in run["rows"]]
        for before, row in zip(tokens, run["rows"][1:], strict=False):
            crossed = row["tokens"] // every > before // every
            last = row is run["rows"][-1]
            assert ("eval/pass@1" in row) == (crossed or last), (name, row["step"], before, row["tokens"])
    report = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_campaign.py"), "--report",
                             str(out / "runs.json.gz")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert f"point of analysis: {design['budget_tokens']} sampled tokens; paired seeds [0, 1]" in report.stdout
    assert "| dars − uniform | pass@1 |" in report.stdout

"""Run health flags (`adarl.metrics.health`) on synthetic metrics rows, and where they are shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adarl.metrics import health
from test_compare import write_run


def rows(**series: list[float | None]) -> list[dict]:
    """Rows for steps 0..n-1 with the given metric values (None: the step does not log it)."""
    n = max(len(v) for v in series.values())
    out = []
    for step in range(n):
        row: dict = {"step": step, "tokens": 100 * step}
        for key, values in series.items():
            if step < len(values) and values[step] is not None:
                row[key] = values[step]
        out.append(row)
    return out


def healthy() -> list[dict]:
    # pass@1 climbs, truncation and length fall, entropy falls to 0.6 of its start
    return rows(**{"eval/pass@1": [0.3, None, 0.4, None, 0.5, None, 0.55],
                   "truncated_fraction": [None, 0.2, 0.15, 0.12, 0.1, 0.1, 0.08],
                   "response_length": [None, 40, 38, 37, 35, 34, 33],
                   "entropy": [None, 1.0, 0.9, 0.8, 0.7, 0.65, 0.6]})


def test_a_healthy_run_has_no_flags():
    assert health.check(healthy()) == []


def test_eval_below_start_and_where_it_began():
    # start 0.40; line 0.40 - 0.02 = 0.38. Evals 0.40, 0.45, 0.37, 0.42, 0.35, 0.30: the final stretch
    # below 0.38 is 0.35 (step 4), 0.30 (step 5); the 0.37 at step 2 was followed by a recovery
    r = rows(**{"eval/pass@1": [0.40, 0.45, 0.37, 0.42, 0.35, 0.30]})
    flag = health.eval_below_start(r)
    assert flag is not None and flag.step == 4 and flag.metric == "eval/pass@1"
    assert "0.300 at the end, below its start 0.400" in str(flag)
    # 0.39 ends within 0.02 of the start: noise on 400 problems, not flagged
    assert health.eval_below_start(rows(**{"eval/pass@1": [0.40, 0.45, 0.39]})) is None


def test_a_fall_within_the_noise_of_the_problems_scored_is_not_flagged():
    """1.96·√(p₀(1−p₀)/n + p₁(1−p₁)/n) by hand. A 1-step quickstart on 10 problems went 0.5 -> 0.3 and was
    flagged; that is noise: √(0.025 + 0.021) = 0.214, ×1.96 = 0.420 > 0.2."""
    def evals(p, n):
        return rows(**{"eval/pass@1": p, "eval/problems": [n] * len(p)})

    assert health.eval_below_start(evals([0.5, 0.3], 10)) is None
    # 400 problems, 0.50 -> 0.40: √((0.25 + 0.24)/400) = 0.0350, ×1.96 = 0.0686 < 0.10: flagged
    flag = health.eval_below_start(evals([0.5, 0.45, 0.4], 400))
    assert flag is not None and flag.step == 2
    # 400 problems, 0.50 -> 0.45: √((0.25 + 0.2475)/400) = 0.0353, ×1.96 = 0.0691 > 0.05: not flagged
    assert health.eval_below_start(evals([0.5, 0.45], 400)) is None
    # all right or all wrong at both ends: no binomial noise, the 0.02 line alone
    assert health.eval_below_start(evals([1.0, 0.0], 400)) is not None


def test_truncation_that_keeps_rising():
    # last 10 steps 1..10 with fraction 0.01·step: slope 0.01 per step, fitted rise 0.01 · 9 = 0.09 ≥ 0.05;
    # the lowest value in the window is at step 1
    r = rows(truncated_fraction=[None] + [0.01 * s for s in range(1, 11)])
    flag = health.rising(r, "truncated_fraction")
    assert flag is not None and flag.step == 1 and "rose +0.090 over the last 10 steps" in flag.detail
    # a rise of 0.004 per step is 0.036 over the window: under 0.05, not flagged
    assert health.rising(rows(truncated_fraction=[0.004 * s for s in range(10)]), "truncated_fraction") is None
    # a rise that has turned down: slope over the window 0.1, 0.3, 0.5, 0.3, 0.1 is 0 -> not flagged
    assert health.rising(rows(truncated_fraction=[0.1, 0.3, 0.5, 0.3, 0.1]), "truncated_fraction") is None
    # fewer than 5 points: no verdict
    assert health.rising(rows(truncated_fraction=[0.0, 0.5, 1.0]), "truncated_fraction") is None


def test_response_length_that_keeps_rising_is_relative():
    # only the last 10 of 14 steps count: steps 4..13, length 20 + 2·(step − 4) for steps ≥ 4 -> 20 .. 38
    # (fitted start 20, rise 2 · 9 = 18 = 90% ≥ 20%); it began at step 4, the window's lowest point
    lengths = [50, 40, 30, 25] + [20 + 2 * i for i in range(10)]
    flag = health.rising(rows(response_length=lengths), "response_length")
    assert flag is not None and flag.step == 4 and "+90%" in flag.detail
    # 100 -> 109 over the window is 9%: not flagged
    assert health.rising(rows(response_length=[100 + i for i in range(10)]), "response_length") is None


def test_entropy_collapse():
    # start = mean of the first three logged values (1.0, 0.9, 0.8) = 0.9; line 10% = 0.09.
    # Values below it: 0.08 (step 5), 0.05 (step 6), 0.03 (step 7) -> began at step 5
    r = rows(entropy=[None, 1.0, 0.9, 0.8, 0.2, 0.08, 0.05, 0.03])
    flag = health.entropy_collapse(r)
    assert flag is not None and flag.step == 5 and "below 10% of its start 0.9" in flag.detail
    # 0.1 at the end is above 0.09: not flagged
    assert health.entropy_collapse(rows(entropy=[1.0, 0.9, 0.8, 0.3, 0.1])) is None


def test_leaving_the_teacher():
    # start = mean of the first three logged gaps (-2.0, -2.5, -3.0) = -2.5; line -3.5.
    # Below it: -4.0 (step 5), -5.5 (step 6); -3.4 (step 4) is not -> began at step 5
    r = rows(**{"distill/gap": [None, -2.0, -2.5, -3.0, -3.4, -4.0, -5.5]})
    flag = health.leaving_the_teacher(r)
    assert flag is not None and flag.step == 5 and flag.metric == "distill/gap"
    assert "fell from -2.50 to -5.50 nats" in flag.detail and "answers in the policy's own way" in flag.detail
    # a healthy distillation: the gap rises towards 0
    assert health.leaving_the_teacher(rows(**{"distill/gap": [-0.5, -0.4, -0.3, -0.1, -0.05]})) is None
    # -3.4 at the end is above the line: not flagged
    assert health.leaving_the_teacher(rows(**{"distill/gap": [-2.0, -2.5, -3.0, -4.0, -3.4]})) is None
    assert health.leaving_the_teacher(rows(**{"distill/gap": [-2.0, -2.5, -9.0]})) is None  # too few


def test_the_kept_distillation_runs_are_flagged_only_where_they_collapsed():
    """The committed runs: OPD and AOPD under the mixed pool's SFT teacher (held-out pass@1 down to 0.11-0.14)
    are flagged; OPD from the quickstart's RL-trained teacher on the revisited pool (5 seeds) is not."""
    from adarl.runs import read_metrics

    kept = Path(__file__).resolve().parents[2] / "bench" / "results" / "campaign"
    collapsed = kept / "mixed/teacher/sft-n400/stopped"
    for run in [collapsed / "opd" / "seed0.jsonl", collapsed / "opd" / "seed1.jsonl",
                *sorted((collapsed / "aopd").glob("seed*.jsonl"))]:
        lines = run.read_text().splitlines()
        assert health.leaving_the_teacher([json.loads(x) for x in lines]) is not None, run
    for run in sorted((kept / "revisited/n24-e120-b12000/opd").glob("seed*")):
        assert health.leaving_the_teacher(read_metrics(run)) is None, run


@pytest.mark.heavy
def test_flags_reach_the_comparison_and_the_report(tmp_path):
    import adarl.comparison as comparison
    from adarl.report import render

    run = write_run(tmp_path / "cmp" / "A" / "seed0", {0: 0.5, 2: 0.2, 4: 0.1}, steps=4, tokens_per_step=100)
    write_run(tmp_path / "cmp" / "A" / "seed1", {0: 0.5, 2: 0.6, 4: 0.7}, steps=4, tokens_per_step=100, seed=1)
    result = comparison.aggregate_dir(tmp_path / "cmp")
    a = result["recipes"][0]
    assert a["flagged_runs"] == 1 and a["runs"][1]["flags"] == []
    assert a["runs"][0]["flags"] == ["eval/pass@1: held-out pass@1 0.100 at the end, below its start 0.500 "
                                     "(from step 2)"]
    assert comparison.summary_rows(result)[1][0][-1] == "1 run(s) flagged"
    text = render(tmp_path / "cmp")
    assert '<tr class="flagged">' in text and "below its start 0.500 (from step 2)" in text
    single = render(run)
    assert "below its start 0.500" in single
    assert "no flags" in render(tmp_path / "cmp" / "A" / "seed1")


def test_train_prints_flags_after_done(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import adarl.train.trainer as trainer_module
    from adarl.cli import app

    written = write_run(tmp_path / "written", {0: 0.5, 2: 0.2}, steps=2, tokens_per_step=100, finished=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text((written / "config.yaml").read_text())
    target = tmp_path / "out"

    class FakeTrainer:  # "trains" by writing the metrics of a run whose pass@1 fell from 0.5 to 0.2
        def __init__(self, recipe, run_dir):
            pass

        def run(self, resume=False):
            target.mkdir()
            (target / "metrics.jsonl").write_text((written / "metrics.jsonl").read_text())
            return json.loads((written / "metrics.jsonl").read_text().splitlines()[-1])

    monkeypatch.setattr(trainer_module, "Trainer", FakeTrainer)
    result = CliRunner().invoke(app, ["train", str(recipe), "--run-dir", str(target)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done: step=2, tokens=200"))
    assert lines[done + 1] == ("health: eval/pass@1: held-out pass@1 0.200 at the end, below its start 0.500 "
                               "(from step 2)")


@pytest.mark.parametrize("value", [float("nan"), True, "x"])
def test_values_that_are_not_numbers_are_skipped(value):
    r = rows(entropy=[1.0, 0.9, 0.8, 0.01])
    r[3]["entropy"] = value  # the collapse step is unreadable: 3 values left, too few for a verdict
    assert health.entropy_collapse(r) is None


def test_health_reads_only_metrics_rows(tmp_path: Path):
    # a run directory's metrics feed check() unchanged: the synthetic runs of test_compare are healthy
    from adarl.runs import read_metrics

    run = write_run(tmp_path / "run", {0: 0.2, 2: 0.4, 4: 0.5}, steps=4, tokens_per_step=100)
    assert health.check(read_metrics(run)) == []

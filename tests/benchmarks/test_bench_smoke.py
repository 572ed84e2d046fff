"""Every benchmark script runs to its end at its smallest setting, through its real entry point (issue 38).

Each test starts `python bench/<name>.py --smoke ...` (or the script's own smallest flags) as a process of its
own (forked from a warm parent: tests/warm_python.py) on the tiny random model, with the hf backend and no
network, and checks the result it wrote: the counts it was asked for, both sides ran, ratios positive and
finite. The times and figures mean nothing here.
bench/vs_trl.py is tested in test_bench.py, bench/gpu_check.py in tests/models/test_device.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")


_TEST: list = []  # the running test's request: `bench` asks it for the session's warm parent when it needs one


@pytest.fixture(autouse=True)
def current_test(request):
    _TEST[:] = [request]


def bench(name: str, *args: str, cwd: Path, returncode: int = 0, timeout: float = 300) -> str:
    """Run bench/<name>.py with `args` in `cwd` (a temporary folder: nothing is written into the repository);
    its stdout, after asserting its exit status. A process of its own, forked from the warm parent (the
    script's imports of torch and transformers are already done: tests/warm_python.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "ADARL_AUTO_BACKEND": "hf",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    warm = _TEST[0].getfixturevalue("warm_python")  # started once per session, by the first test needing it
    proc = warm.run_script(ROOT / "bench" / f"{name}.py", list(args), env=env, cwd=cwd, timeout=timeout,
                           stderr_apart=True)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_every_benchmark_script_has_a_test_that_runs_it():
    """A script in bench/ (a file with a `__main__`) is run by a test here, in test_bench.py or, for
    bench/gpu_check.py, in tests/models/test_device.py; libraries (equal_budget, methods, ...) are not scripts."""
    tests = "".join(p.read_text() for p in [*Path(__file__).parent.glob("test_*.py"),
                                             ROOT / "tests" / "models" / "test_device.py"])
    scripts = [p.stem for p in sorted((ROOT / "bench").glob("*.py")) if "__main__" in p.read_text()]
    assert "vs_trl" in scripts and "equal_budget" not in scripts
    assert [s for s in scripts if f'"{s}"' not in tests and f'"{s}.py"' not in tests] == []


def test_allocation_overhead_smoke_times_every_combination(tmp_path, monkeypatch):
    """--smoke: 1,000 prompts, 8 selected, 3 steps; no model."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from allocation_overhead import COMBOS

    out = tmp_path / "overhead.json"
    stdout = bench("allocation_overhead", "--smoke", "--out", str(out), cwd=tmp_path)
    rows = json.loads(out.read_text())
    assert [(r["select"], r["allocate"]) for r in rows] == [(s["name"], a["name"]) for s, a in COMBOS]
    assert all(positive(r["ms_per_step"]) for r in rows), rows
    assert stdout.startswith("1,000 prompts, 8 selected per step, median over 2 steps")


def test_scale_7b_prints_its_tables_from_the_kept_results(tmp_path):
    """No flag: it reads bench/results only. Each table's total is the sum of its parts (to the rounding)."""
    stdout = bench("scale_7b", cwd=tmp_path)
    assert stdout.startswith("7B: 7.62B parameters")
    rows = [[float(x) for x in line.strip("|").split("|")] for line in stdout.splitlines()
            if re.match(r"\| \d", line)]
    memory, steps = [r for r in rows if len(r) == 7], [r for r in rows if len(r) == 10]
    assert [int(r[0]) for r in memory] == [4, 6, 8, 16, 30] and len(steps) == 5
    for _k, *parts, total, rank0 in memory:
        assert sum(parts) == pytest.approx(total, abs=0.25) and rank0 > total
    for _gpus, _k, _w, _rollouts, generate, update, publish, step, tok_s, update_low in steps:
        assert generate + update + publish == pytest.approx(step, abs=0.25) and positive(tok_s)
        assert update_low >= update


def test_generate_smoke_runs_the_hf_backend_and_model_generate(tiny_model_dir, tmp_path):
    """--smoke: 4 prompts × 2 rollouts of at most 8 tokens, once, hf and model.generate."""
    out = tmp_path / "generate.json"
    bench("generate", "--smoke", "--model", str(tiny_model_dir), "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["setup"] == {"rows": 8, "max_new_tokens": 8, "repeats": 1, "threads": result["setup"]["threads"]}
    for side in ("model_generate", "adarl_hf"):
        assert 8 <= result[side]["tokens"] <= 64 and positive(result[side]["tokens_per_s"]), result[side]
    assert positive(result["adarl_hf_ratio"]) and "adarl_vllm" not in result


def test_quantized_sampling_smoke_measures_both_int8_copies(tiny_model_dir, tmp_path):
    """--smoke: 32 keyed rows of at most 8 tokens from float32 and two int8 copies, one repeat."""
    out = tmp_path / "quantized.json"
    bench("quantized_sampling", "--smoke", "--model", str(tiny_model_dir), "--threads", "1", "--out", str(out),
          cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["max_new_tokens"] == 8 and len(result["results"]) == 3
    assert result["results"]["float32"]["kl_from_float32"] == 0.0
    for name, r in result["results"].items():
        assert positive(r["tokens_per_s"]) and positive(r["speed_vs_float32"]), name
        if name != "float32":  # a quantized copy is not the float32 model: some drift, and small
            assert 0 < r["kl_from_float32"] < 1, (name, r)


def test_decode_cost_smoke_fits_the_step_cost_and_bounds_partial_rollouts(tiny_model_dir, tmp_path):
    """--smoke: the hf step at 1 and 2 rows; the lengths of a long-tailed step from --lengths-from."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"lengths": [2, 5, 8, 8]}))
    out = tmp_path / "decode_cost.json"
    bench("decode_cost", "--smoke", "--model", str(tiny_model_dir), "--lengths-from", str(lengths),
          "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    hf = result["hf"]
    assert set(hf["seconds_per_step"]) == {"1", "2"} and all(map(positive, hf["seconds_per_step"].values()))
    assert "vllm" not in result and result["lengths"] == [2, 5, 8, 8]
    a, b = hf["fixed_s"], hf["per_row_s"]
    # rows alive at decode steps 0..7: 4, 4, 3, 3, 3, 2, 2, 2 (23 tokens), so sync costs (8a + 23b) / 23 a token;
    # a batch kept at 4 rows costs (a + 4b) / 4 a token, at 8 rows (a + 8b) / 8
    assert hf["partial_bound"] == pytest.approx((8 * a + 23 * b) / 23 / ((a + 4 * b) / 4))
    assert hf["partial_bound_2x_rows"] == pytest.approx((8 * a + 23 * b) / 23 / ((a + 8 * b) / 8))


def test_memory_smoke_steps_both_modes_in_their_own_processes(tiny_model_dir, tmp_path):
    """--smoke: one step of 2 sequences of 16 tokens, plain full logits and adarl's chunked path."""
    out = tmp_path / "memory.json"
    bench("memory", "--smoke", "--model", str(tiny_model_dir), "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["results"]] == ["plain", "adarl"]
    for r in result["results"]:
        assert r["peak_rss_gb"] >= r["model_loaded_rss_gb"] > 0, r
    assert positive(result["ratio"]) and result["args"]["batch"] == 2 and result["args"]["tokens"] == 16


def test_tree_speed_smoke_samples_every_policy(tiny_model_dir, tmp_path):
    """--smoke: 2 prompts × 8 rows of at most 8 tokens per policy, one repeat."""
    out = tmp_path / "tree_speed.json"
    stdout = bench("tree_speed", "--smoke", "--model", str(tiny_model_dir), "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    assert (result["prompts"], result["n"], result["max_new_tokens"]) == (2, 8, 8)
    policies = result["policies"]
    assert list(policies) == ["independent", "eptree", "eptree7", "eptree3", "treepo8"]
    assert 16 <= policies["independent"]["sampled_tokens"] <= 2 * 8 * 8
    for name, r in policies.items():
        assert len(r["runs"]) == 1 and r["sampled_tokens"] > 0 and positive(r["tokens_per_s"]), name
    assert "| treepo8 |" in stdout


def test_micro_batch_smoke_gives_the_same_update_at_every_size(tiny_model_dir, tmp_path):
    """--smoke: one step (2 prompts × 4 rollouts) per micro-batch size, each in its own process."""
    out = tmp_path / "micro_batch.json"
    bench("micro_batch", "--smoke", "--model", str(tiny_model_dir), "--out", str(out), cwd=tmp_path)
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"64", "32"} and all(len(r) == 1 for r in runs.values())
    (big,), (small,) = runs["64"], runs["32"]
    for r in (big, small):
        assert len(r["train_s"]) == 1 and positive(r["train_s"][0]) and positive(r["peak_gib"])
        assert 0 < r["tokens"][0] <= 2 * 4 * 8
    # the same seed samples the same step; the split into micro-batches leaves the update as it is
    assert big["tokens"] == small["tokens"] and positive(big["grad_norm"][0])
    assert small["grad_norm"][0] == pytest.approx(big["grad_norm"][0], rel=1e-4)


def test_memory_trace_smoke_sees_every_phase(tiny_model_dir, tmp_path):
    """--smoke: 2 steps of the quickstart on the tiny model, with an evaluation and a checkpoint."""
    out = tmp_path / "trace.json"
    stdout = bench("memory_trace", "--smoke", "--model", str(tiny_model_dir), "--recipe", QUICKSTART,
                   "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    peaks = result["peaks"]
    assert {"load", "step", "generate+verify", "update", "eval", "checkpoint", "final", "report"} <= set(peaks)
    assert all(positive(gb) for gb in peaks.values())
    # the process's peak is no lower than any sample (the kernel updates VmHWM lazily: within 1%)
    assert result["vmhwm_gb"] >= 0.99 * max(peaks.values())
    assert "process peak (VmHWM)" in stdout


def test_objectives_smoke_times_and_trains_each_kind_of_component(tiny_model_dir, tmp_path):
    """--overhead --quality --smoke: an advantage with a shaping, and a loss with an adaptive temperature, against
    plain GRPO, on one batch of 2 prompts × 8 rollouts; quality: each trains to 128 tokens."""
    names = ["grpo", "hbpo", "hapo"]
    out = tmp_path / "objectives.json"
    bench("objectives", "--overhead", "--quality", "--smoke", "--objectives", ",".join(names), "--model",
          str(tiny_model_dir), "--recipe", QUICKSTART, "--runs", str(tmp_path / "runs"), "--results",
          str(tmp_path / "results"), "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    overhead = {r["component"]: r for r in result["overhead"]}
    assert list(overhead) == [*names, "adaptive_temperature (generation)"]
    assert overhead["grpo"]["overhead"] == 0.0
    for name in names:
        row = overhead[name]
        assert positive(row["update_s"]) and math.isfinite(row["overhead"]) and positive(row["loss_ms"]), row
        assert 0 < row["trained_tokens"] <= 2 * 8 * 16, row  # the reward is earned: not every advantage is 0
    quality = result["quality"]
    assert [r["objective"] for r in quality] == names
    for row in quality:
        assert 0 <= row["final_mean"] <= 1 and row["final_std"] == 0.0 and positive(row["entropy"]), row
    for name in names:  # the runs' metrics are kept, so a second call reuses them
        assert (tmp_path / "results" / "b128" / name / "seed0" / "metrics.jsonl").is_file()


def test_longtail_smoke_trains_sync_and_partial_to_the_budget(tiny_model_dir, tmp_path):
    """--smoke: each mode trains seed 0 to 128 generated tokens."""
    modes = ["sync", "partial"]
    out = tmp_path / "longtail.json"
    stdout = bench("longtail", "--smoke", "--modes", ",".join(modes), "--model", str(tiny_model_dir), "--recipe",
                   QUICKSTART, "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
                   "--out", str(out), cwd=tmp_path)
    table = json.loads(out.read_text())
    assert [r["mode"] for r in table] == modes and all(r["runs"] == 1 for r in table)
    assert table[0]["vs_sync"] == 1.0
    for row in table:
        assert positive(row["throughput"]) and positive(row["end_to_end"]) and positive(row["vs_sync"]), row
        assert row["end_to_end"] <= row["throughput"]  # the whole step is longer than its generation
        assert 0 <= row["final_mean"] <= 1, row
    for mode in modes:
        rows = [json.loads(x) for x in (tmp_path / "results" / "b128" / mode / "seed0" / "metrics.jsonl").open()]
        assert 0 < rows[-1]["tokens"] <= 128 + 2 * 4 * 8, rows[-1]  # a step may pass the budget by one step's worth
    assert "128 generated tokens per run; seeds [0]" in stdout


def test_branching_smoke_samples_every_policy_and_tabulates_it(tiny_model_dir, tmp_path, monkeypatch):
    """--smoke: every policy, 2 held-out prompts × 8 leaves, seed 0; one file per policy, then the table."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from tree_policies import POLICIES

    out = tmp_path / "branching"
    stdout = bench("branching", "--smoke", "--model", str(tiny_model_dir), "--threads", "1", "--recipe", QUICKSTART,
                   "--out", str(out), cwd=tmp_path)
    for policy in POLICIES:
        r = json.loads((out / "addition" / policy / "seed0.json").read_text())
        assert (r["prompts"], r["n"], r["seed"]) == (2, 8, 0), policy
        pass_at = [r["pass@k"][str(k)] for k in range(1, 9)]
        # pass@k rises with k
        assert all(0 <= a <= b <= 1 for a, b in zip(pass_at, pass_at[1:], strict=False)), (policy, pass_at)
        assert r["sampled_tokens"] > 0 and positive(r["tokens_per_s"]) and 0 <= r["useful_token_fraction"] <= 1
        assert (r["branch_metrics"] == {}) == (POLICIES[policy] is None), policy
        if policy == "independent":
            assert r["sampled_tokens"] <= 2 * 8 * 8
    assert all(f"| {policy} | 1 |" in stdout for policy in POLICIES)


def test_behaviour_tiny_trains_the_five_recipes_and_reports_a_difference(tmp_path):
    """--tiny --steps 1: the five recipes on the tiny model; against a file that differs, it says so and exits 1."""
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"fixed": [{"step": 99}]}))
    out = tmp_path / "after.json"
    stdout = bench("behaviour", "--tiny", "--steps", "1", "--out", str(out), "--against", str(before), cwd=tmp_path,
                   returncode=1)
    result = json.loads(out.read_text())
    assert list(result) == ["fixed", "vade+dars", "partial", "agent", "eptree+treerl"]
    for name, rows in result.items():
        assert [row["step"] for row in rows] == [0, 1], name  # the evaluation row at the start, then the step
        assert not any(k.endswith("_s") or "per_s" in k for row in rows for k in row), name  # timings left out
    assert "fixed row 0: differs in" in stdout and "fixed: 1 rows before, 2 after" in stdout
    assert stdout.rstrip().endswith("2 differences")


def test_scale_smoke_in_process_generates_trains_and_models_the_scaling(tiny_model_dir, tmp_path):
    """--smoke --setups in-process: the Ray set-ups take minutes to start here (tests/cluster tests the pool)."""
    out = tmp_path / "scale.json"
    bench("scale", "--smoke", "--setups", "in-process", "--model", str(tiny_model_dir), "--runs",
          str(tmp_path / "runs"), "--out", str(out), cwd=tmp_path)
    result = json.loads(out.read_text())
    generation = result["generation_only"]["in-process"]
    assert 0 < generation["tokens"] <= 2 * 2 * 8 and len(generation["seconds"]) == 2
    setup = result["setups"]["in-process"]
    assert len(setup["steps"]) == 2 and 0 < setup["step_tokens"] <= 2 * 2 * 8 and positive(setup["tokens_per_s"])
    cpu = result["model"]["cpu (measured)"]
    assert [row["workers"] for row in cpu] == [1, 2, 4, 8, 16, 32, 64]
    for row in cpu:  # the model of the module docstring, from the measured in-process figures (no Ray worker ran)
        generate = setup["step_tokens"] / (row["workers"] * setup["tokens_per_s"])
        assert row["generate_s"] == pytest.approx(generate)
        assert row["step_s"] == pytest.approx(generate + setup["train_s"] + row["broadcast_s"])
        assert row["tokens_per_s"] == pytest.approx(setup["step_tokens"] / row["step_s"])


def tiny_recipe(tmp_path: Path, model_dir: Path) -> Path:
    """The quickstart on the tiny model at bench/smoke.py's smallest run (bench/allocation.py and bench/ladder.py
    take a recipe, not overrides)."""
    import yaml

    recipe = yaml.safe_load(Path(QUICKSTART).read_text())
    recipe["model"]["path"] = str(model_dir)
    recipe["rollout"].update(backend="hf", max_new_tokens=8)
    recipe["budget"]["prompts_per_step"], recipe["allocate"]["n"] = 2, 4
    recipe["task"].update(size=16, eval_size=4)
    recipe["rewards"] = [{"type": "format", "pattern": "[aeiou]", "correctness": True}]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_ladder_at_its_smallest_trains_the_rungs_and_tabulates_them(tiny_model_dir, tmp_path):
    """No smoke flag (bench/allocation.py, whose queue it uses, is being changed elsewhere): a tiny recipe, one
    seed, 128 tokens, uniform against a hint and self-distillation."""
    stdout = bench("ladder", "--recipe", str(tiny_recipe(tmp_path, tiny_model_dir)), "--task", "addition",
                   "--methods", "uniform,guide,sdar", "--seeds", "0", "--budget-tokens", "128", "--eval-every", "0",
                   "--eval-size", "4", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
                   cwd=tmp_path)
    # the ladder's table: plain / more / hinted / distilled groups a run climbed to
    rungs = {m.group(1): [int(x) for x in m.groups()[1:]] for line in stdout.splitlines()
             if (m := re.match(r"\| (\w+) \| 1 \| \d+ \| [^|]+ \| (\d+) / (\d+) / (\d+) / (\d+) \|", line))}
    assert set(rungs) == {"uniform", "guide", "sdar"}, stdout
    assert rungs["uniform"][0] > 0 and rungs["uniform"][2:] == [0, 0]
    assert rungs["guide"][2] > 0 and rungs["sdar"][3] > 0  # guide hinted a group, sdar distilled one
    assert "paired differences to uniform at 128 tokens" in stdout


def test_allocation_at_its_smallest_trains_each_method_to_the_budget(tiny_model_dir, tmp_path):
    """No smoke flag (the script is being changed elsewhere): a tiny recipe, one seed, 128 tokens, uniform
    against DARS (its second stage tops groups up)."""
    out = tmp_path / "allocation.json"
    bench("allocation", "--recipe", str(tiny_recipe(tmp_path, tiny_model_dir)), "--tasks", "addition", "--methods",
          "uniform,dars", "--seeds", "0", "--budget-tokens", "128", "--eval-every", "0", "--eval-size", "4",
          "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--out", str(out), cwd=tmp_path)
    report = json.loads(out.read_text())
    rows = report["tasks"]["addition"]
    assert [r["method"] for r in rows] == ["uniform", "dars"] and all(r["seeds"] == 1 for r in rows)
    for row in rows:
        (run,) = row["curves"]
        # held-out pass@1 at the start and at the end, when the budget is spent
        assert run["tokens"][0] == 0 and 128 <= run["tokens"][-1] <= 128 + 2 * 4 * 8, run
        assert all(0 <= p <= 1 for p in run["pass@1"]) and row["final_mean"] == run["pass@1"][-1]
    (paired,) = report["paired"]["addition"]
    assert paired["method"] == "dars" and paired["pass@1_at_budget"]["n"] == 1

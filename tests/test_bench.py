"""The benchmarks run to their end at their smallest setting (times mean nothing here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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

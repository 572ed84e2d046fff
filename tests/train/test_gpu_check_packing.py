"""bench/gpu_check.py's `packing` section (issue 50) runs on the CPU at its smallest setting, and its needed-FLOPs
count is the hand-worked one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.model


def test_needed_flops_count_each_prompt_once():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import needed_flops

    shape = {"hidden_size": 2, "num_hidden_layers": 3, "vocab_size": 5}
    # params 100, head 5·2 = 10 → body 90; one group: prompt 3 + 2 completions of 2 = 7 tokens
    # causal key-query pairs: prompt 1+2+3 = 6, each completion (4 + 5) = 9 → 6 + 18 = 24
    expected = 6 * 90 * 7 + 6 * 10 * 4 + 12 * 3 * 2 * 24
    assert needed_flops(shape, 100, groups=1, n=2, prompt_len=3, completion_len=2) == expected


def test_the_packing_section_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--sections", "packing", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["packing"]
    assert "error" not in result["qwen-tiny-a"], result["qwen-tiny-a"].get("traceback")
    row = result["qwen-tiny-a"]["16x16x8"]
    for label in ("padded", "packed", "shared", "shared_rows_4096"):
        assert row[label]["seconds"] > 0 and row[label]["mfu_needed"] is None  # a CPU: no peak to divide by
    assert row["shared"]["tokens_per_s_vs_padded"] > 0

"""bench/delta_sync.py runs, and a bf16 model's delta after an AdamW step at lr 1e-6 is a small share of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_delta_sync_bench_runs_and_sends_a_small_share(tmp_path):
    out = tmp_path / "delta_sync.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "delta_sync.py"), "--lrs", "1e-6", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    # bf16 words: embedding and its tied head (both names are sent) 2 x 512 x 128, two layers of q 128x128,
    # k and v 128x64, o 128x128, gate, up and down 128x256 and two norms of 128 (147,712 each), a final norm
    assert run["full_bytes"] == 2 * (2 * 65_536 + 2 * 147_712 + 128)
    assert all(0 < f <= 0.2 for f in run["delta_over_full"])

"""bench/learner_update.py runs end to end on a tiny model, and the three layouts train alike."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.model
SCRIPT = "learner_update"  # bench/learner_update.py


def test_the_learner_benchmark_smoke(tiny_model_dir, tmp_path):
    learner_update = importlib.import_module(SCRIPT)

    out = tmp_path / "result.json"
    assert learner_update.main(["--smoke", "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["layouts"]
    assert set(rows) == {"padded", "packed", "shared"}
    # 2 prompts × 2 rollouts: the shared layout forwards each prompt once (and the chat template's common
    # head of the two prompts once), so at least two prompts fewer than packed
    assert rows["shared"]["forwarded_tokens"] <= rows["packed"]["forwarded_tokens"] - 2 * result["prompt_tokens_mean"]
    assert rows["packed"]["forwarded_tokens"] <= rows["padded"]["forwarded_tokens"]
    norms = [rows[k]["grad_norm"] for k in rows]
    assert max(norms) == pytest.approx(min(norms), rel=1e-4)


def test_bad_completion_range_is_one_clear_error():
    learner_update = importlib.import_module(SCRIPT)

    with pytest.raises(SystemExit):
        learner_update.parse_args(["--completion", "5,2"])

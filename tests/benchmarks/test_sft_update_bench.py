"""bench/sft_update.py runs end to end on a tiny model: the two layouts train alike, the shared one forwards
fewer tokens."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.model


def test_the_sft_benchmark_smoke(tiny_model_dir, tmp_path):
    sft_update = importlib.import_module("sft_update")  # bench/sft_update.py

    out = tmp_path / "result.json"
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
    assert sft_update.main(["--smoke", "--model", str(tiny_model_dir), "--recipe", recipe, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert rows["shared"]["forwarded_per_step"] < rows["padded"]["forwarded_per_step"]
    assert rows["shared"]["trained_per_step"] == rows["padded"]["trained_per_step"] > 0
    assert rows["shared"]["final_loss"] == pytest.approx(rows["padded"]["final_loss"], rel=1e-4)


def test_one_step_is_refused():
    with pytest.raises(SystemExit):
        importlib.import_module("sft_update").parse_args(["--steps", "1"])

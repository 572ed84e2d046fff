"""bench/campaign.py's tokens table charges a distillation teacher's own training tokens (issue 49)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from campaign import teacher_tokens, tokens_ratio_table  # noqa: E402


def test_the_teacher_s_tokens_are_charged_in_a_second_row(capsys: pytest.CaptureFixture) -> None:
    grid = np.array([0.0, 100.0, 200.0])
    curves = {"uniform": [(grid, np.array([0.2, 0.4, 0.5])), (grid, np.array([0.1, 0.3, 0.4]))],
              "opd": [(grid, np.array([0.2, 0.5, 0.6])), (grid, np.array([0.1, 0.2, 0.6]))]}
    done = {"uniform": [0, 1], "opd": [0, 1]}
    rows = {r["method"]: r for r in tokens_ratio_table("pool", curves, done, 200, {"opd": 300})}
    # seed 0: opd reaches uniform's final 0.5 at 100 tokens (ratio 100/200); seed 1: it crosses 0.4 between
    # (100, 0.2) and (200, 0.6) at 100 + 0.2/0.4 * 100 = 150 (ratio 0.75). With the teacher's 300 tokens:
    # (100 + 300)/200 = 2.0 and (150 + 300)/200 = 2.25
    assert rows["opd"]["per_seed"] == pytest.approx({0: 0.5, 1: 0.75})
    charged = rows["opd + its teacher's 300 tokens"]
    assert charged["per_seed"] == pytest.approx({0: 2.0, 1: 2.25}) and charged["verdict"] == "no difference shown"
    assert "| opd + its teacher's 300 tokens | 2 | 2/2 | 2.00, 2.25 |" in capsys.readouterr().out


def test_teacher_tokens_come_from_the_run_that_trained_it(tmp_path: Path) -> None:
    run = tmp_path / "teacher-run"
    (run / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens": t}) + "\n"
                                               for i, t in enumerate((0, 1000, 31_400))))
    assert teacher_tokens(run / "final") == 31_400 and teacher_tokens(run) == 31_400
    assert teacher_tokens(tmp_path / "elsewhere") is None

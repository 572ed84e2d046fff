"""A benchmark's kept runs packed into its runs.tar.gz (bench/equal_budget.py) read back as the plain files did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def kept(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    sys.modules.pop("equal_budget", None)
    import equal_budget

    return equal_budget


def test_packed_runs_read_back_as_the_files_did(kept, tmp_path):
    results = tmp_path / "allocation"
    run = results / "addition" / "b100" / "uniform" / "seed0"
    run.mkdir(parents=True)
    rows = [{"step": 0, "tokens": 0, "eval/pass@1": 0.25}, {"step": 1, "tokens": 90, "eval/pass@1": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (results / "addition" / "b100" / "uniform" / "seed1").mkdir()
    (results / "addition" / "b100" / "uniform" / "seed1" / "result.json").write_text("{}")  # a summary: stays
    (results / "table.json").write_text("{}")
    (results / "addition" / "eptree").mkdir()
    (results / "addition" / "eptree" / "seed0.json").write_text('{"seed": 0}')  # bench/branching.py's per-seed file

    assert kept.archive_runs(results) == 2
    assert not run.exists() and (results / "addition/b100/uniform/seed1/result.json").exists()
    assert kept.read_kept(results / "addition" / "eptree" / "seed0.json") == '{"seed": 0}'
    assert (results / "table.json").exists()
    assert kept.read_kept(run / "metrics.jsonl") == "".join(json.dumps(r) + "\n" for r in rows)
    assert kept.read_kept(results / "addition" / "b100" / "uniform" / "seed9" / "metrics.jsonl") is None
    # what a benchmark's --report-only asks: the run is done, from the archive, with nothing trained
    assert kept.train_run("recipe.yaml", [], tmp_path / "runs", "uniform seed 0", report_only=True,
                          results=run) == rows

    packed = (results / "runs.tar.gz").read_bytes()
    assert kept.archive_runs(results) == 0 and (results / "runs.tar.gz").read_bytes() == packed  # same bytes
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")  # a run redone: the file beats its old copy
    (results / "addition" / "b100" / "vade" / "seed0").mkdir(parents=True)
    (results / "addition" / "b100" / "vade" / "seed0" / "metrics.jsonl").write_text("{}\n")
    assert kept.archive_runs(results) == 2
    assert kept.read_kept(run / "metrics.jsonl") == json.dumps(rows[0]) + "\n"
    assert kept.read_kept(results / "addition" / "b100" / "vade" / "seed0" / "metrics.jsonl") == "{}\n"


def test_the_committed_archives_hold_no_file_the_tree_holds_too(kept):
    """A run is either packed or plain, so the tree and the archive never disagree about it."""
    import tarfile

    for archive in sorted((ROOT / "bench" / "results").glob("*/runs.tar.gz")):
        with tarfile.open(archive) as tar:
            names = tar.getnames()
        assert names and not [n for n in names if (archive.parent / n).exists()], archive

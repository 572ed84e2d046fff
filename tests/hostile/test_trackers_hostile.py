"""A tampered ``trackers.json`` in a resumed run: checked against its schema before any tracker starts.

The file names the W&B and MLflow runs a resumed run continues, and it held the MLflow store's URI,
which was used as found: a foreign ``http://`` URI sent MLflow requests to any server. Now a resume
refuses, with one TrackerError naming the file and what is wrong, anything but known trackers, run
ids of 1 to 64 word characters, and the store the recipe sets (``log.mlflow_uri``, else the run's
``mlruns``). Every case asserts that error, no socket connect, the file left as it was, and a
time cap of 5 s (the first case pays for importing wandb and mlflow).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from adarl.config import Recipe
from adarl.metrics import trackers as tracking
from adarl.metrics.sinks import MetricsWriter
from adarl.metrics.trackers import STATE_FILE, TrackerError
from conftest import isolate_trackers

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

MLFLOW_ID = "0123456789abcdef0123456789abcdef"
WANDB_ID = "a1b2c3d4"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Trackers' caches under the test's directory; every socket connect recorded and refused."""
    isolate_trackers(tmp_path / "wandb-home", monkeypatch)
    connects: list[object] = []

    def refuse(self, address, *args, **kwargs):
        connects.append(address)
        raise ConnectionRefusedError(f"test: no network ({address!r})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return connects


def recipe(trackers=("wandb", "mlflow"), **log) -> dict:
    return Recipe(name="tiny", task={"source": "reasoning_gym", "name": "basic_arithmetic"},
                  log={"trackers": list(trackers), **log}).model_dump(mode="json")


def default_uri(run: Path) -> str:
    return (run.resolve() / "mlruns").as_uri()


def good(run: Path) -> dict:
    return {"wandb": {"run_id": WANDB_ID}, "mlflow": {"run_id": MLFLOW_ID, "uri": default_uri(run)}}


# (id, what trackers.json holds: bytes, or a function of the run dir giving an object to dump, message part)
CASES: list[tuple[str, object, str]] = [
    # a foreign store
    ("http-uri", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": "http://127.0.0.1:9/"}}, "is not the one the"),
    ("https-remote", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": "https://evil.example.com"}}, "is not the one"),
    ("databricks", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": "databricks"}}, "is not the one"),
    ("uri-beside-wandb", lambda r: {**good(r), "mlflow": {"run_id": MLFLOW_ID, "uri": "http://10.0.0.1:5000"}},
     "is not the one"),
    ("other-local-store", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": (r.parent / "elsewhere").as_uri()}},
     "is not the one"),
    ("other-sqlite", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": "sqlite:////tmp/other.db"}}, "is not the one"),
    ("empty-uri", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": ""}}, "is not the one"),
    # junk types
    ("top-list", lambda r: [good(r)], "expected an object of tracker runs, got list"),
    ("top-string", lambda r: "mlflow", "got str"),
    ("top-number", lambda r: 7, "got int"),
    ("top-null", lambda r: None, "got NoneType"),
    ("entry-list", lambda r: {"mlflow": [MLFLOW_ID]}, "mlflow: expected an object, got list"),
    ("entry-string", lambda r: {"wandb": WANDB_ID}, "wandb: expected an object, got str"),
    ("run-id-int", lambda r: {"wandb": {"run_id": 12345678}}, "run_id must be"),
    ("run-id-null", lambda r: {"wandb": {"run_id": None}}, "run_id must be"),
    ("run-id-missing", lambda r: {"wandb": {}}, "run_id must be"),
    ("run-id-list", lambda r: {"mlflow": {"run_id": [MLFLOW_ID], "uri": default_uri(r)}}, "run_id must be"),
    ("uri-int", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": 5000}}, "is not the one"),
    ("uri-dict", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": {"host": "evil"}}}, "is not the one"),
    ("run-id-path", lambda r: {"mlflow": {"run_id": "../../../etc", "uri": default_uri(r)}}, "run_id must be"),
    ("run-id-space", lambda r: {"wandb": {"run_id": "a b"}}, "run_id must be"),
    ("run-id-newline", lambda r: {"wandb": {"run_id": "abc\n"}}, "run_id must be"),
    ("run-id-empty", lambda r: {"wandb": {"run_id": ""}}, "run_id must be"),
    # huge
    ("run-id-65", lambda r: {"wandb": {"run_id": "a" * 65}}, "run_id must be"),
    ("run-id-megabyte", lambda r: {"wandb": {"run_id": "a" * 1_000_000}}, "larger than 65536 bytes"),
    ("uri-50k", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "uri": "http://" + "a" * 50_000}},
     "characters) is not the one"),
    ("ten-megabytes", b" " * 10_000_000 + b"{}", "larger than 65536 bytes"),
    ("nested-60k", b"[" * 60_000 + b"]" * 60_000, "larger than 65536 bytes"),
    ("nested-30k", b"[" * 30_000 + b"]" * 30_000, "not valid JSON"),
    # unknown keys
    ("tracker-evil", lambda r: {**good(r), "evil": {"run_id": "x"}}, "unknown tracker 'evil'"),
    ("tracker-tensorboard", lambda r: {"tensorboard": {"run_id": "x"}}, "unknown tracker 'tensorboard'"),
    ("entry-tracking-uri", lambda r: {"mlflow": {"run_id": MLFLOW_ID, "tracking_uri": "http://evil"}},
     "mlflow: unknown key 'tracking_uri'"),
    ("wandb-uri", lambda r: {"wandb": {"run_id": WANDB_ID, "uri": "http://evil"}}, "wandb: unknown key 'uri'"),
    ("wandb-base-url", lambda r: {"wandb": {"run_id": WANDB_ID, "base_url": "http://evil"}}, "unknown key"),
    ("surrogate-key", b'{"\\ud800": {"run_id": "x"}}', "unknown tracker '\\\\ud800'"),
    # not JSON
    ("invalid-utf8", b'{"wandb": {"run_id": "\xff\xfe"}}', "not valid JSON"),
    ("truncated", b'{"wandb": {"run_id": "a1', "not valid JSON"),
    ("nan", b'{"wandb": {"run_id": NaN}}', "run_id must be"),
    ("empty-file", b"", "not valid JSON"),
]


def write_state(run: Path, content: object) -> bytes:
    run.mkdir(parents=True, exist_ok=True)
    data = content if isinstance(content, bytes) else json.dumps(content(run)).encode()  # type: ignore[operator]
    (run / STATE_FILE).write_bytes(data)
    return data


@pytest.mark.parametrize(("content", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_tampered_state_is_refused_on_resume(content, message, tmp_path, _isolated) -> None:
    run = tmp_path / "run"
    data = write_state(run, content)
    start = time.monotonic()
    with pytest.raises(TrackerError) as err:
        MetricsWriter(run, tensorboard=False, trackers=["wandb", "mlflow"], config=recipe(), resume_step=2)
    assert time.monotonic() - start < 5.0
    text = str(err.value)
    assert text.startswith(f"{run / STATE_FILE}: ") and message in text and "delete it" in text
    assert len(text) < 600  # huge strings are cut in the message
    assert _isolated == []  # no connect, to any address
    assert (run / STATE_FILE).read_bytes() == data  # nothing started, nothing rewritten
    assert not (run / "mlruns").exists() and not (run / "wandb").exists()


def test_artifact_later_refuses_a_tampered_state(tmp_path, _isolated) -> None:
    run = tmp_path / "run"
    write_state(run, CASES[0][1])
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    with pytest.raises(TrackerError, match="is not the one the recipe sets"):
        tracking.log_artifact_later(["mlflow"], run, report, recipe(["mlflow"]))
    assert _isolated == []


def test_a_configured_store_is_accepted_and_a_changed_one_is_named(tmp_path, _isolated) -> None:
    run, store = tmp_path / "run", tmp_path / "store"
    config = recipe(["mlflow"], mlflow_uri=str(store))
    with MetricsWriter(run, tensorboard=False, trackers=["mlflow"], config=config) as w:
        w.write({"step": 1, "reward": 0.5})
    state = json.loads((run / STATE_FILE).read_text())
    assert state["mlflow"]["uri"] == store.resolve().as_uri()
    with MetricsWriter(run, tensorboard=False, trackers=["mlflow"], config=config, resume_step=1) as w:
        w.write({"step": 2, "reward": 0.75})
    assert json.loads((run / STATE_FILE).read_text()) == state  # the same run continued
    with pytest.raises(TrackerError, match=r"trackers.json: mlflow: store .* is not the one the recipe sets \("
                                           + (run.resolve() / "mlruns").as_uri()):
        MetricsWriter(run, tensorboard=False, trackers=["mlflow"], config=recipe(["mlflow"]), resume_step=2)
    assert _isolated == []


def test_a_run_that_starts_over_ignores_the_old_state(tmp_path, _isolated) -> None:
    run = tmp_path / "run"
    write_state(run, CASES[0][1])
    MetricsWriter(run, tensorboard=False, trackers=["mlflow"], config=recipe(["mlflow"]), resume_step=-1).close()
    state = json.loads((run / STATE_FILE).read_text())
    assert set(state) == {"mlflow"} and state["mlflow"]["uri"] == default_uri(run)
    assert state["mlflow"]["run_id"] != MLFLOW_ID
    assert _isolated == []

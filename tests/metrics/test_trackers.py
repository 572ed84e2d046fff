"""log.trackers: W&B (offline) and MLflow (local store) get every row, the recipe and the report.

Each test reads back what the tracker wrote: W&B's own record file (``run-<id>.wandb``, parsed with
wandb's protobuf types) and MLflow through its client on the run directory's store.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from adarl.config import LogConfig, Recipe
from adarl.metrics import trackers as tracking
from adarl.metrics.sinks import MetricsWriter
from adarl.metrics.trackers import TrackerError, check_trackers, flatten, mlflow_name
from conftest import isolate_trackers

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
    """W&B's caches and settings under the test's directory, never the user's home."""
    isolate_trackers(tmp_path / "wandb-home", monkeypatch)


def recipe_dict(**log) -> dict:
    recipe = Recipe(name="tiny", task={"source": "reasoning_gym", "name": "basic_arithmetic"},
                    log={"trackers": ["wandb", "mlflow"], **log})
    return recipe.model_dump(mode="json")


ROWS = [
    {"step": 1, "reward": 0.25, "reward/math": 1.0, "pass_rate": 0.5, "eval/pass@1": 0.4,
     "by_level": {"1": 1.0, "2": 0.0},
     "length_hist": [3, 4, 5], "note": "text", "grad_norm": float("nan")},
    {"step": 2, "reward": 0.75, "pass_rate": 1.0, "flag": True},
]


# ----------------------------------------------------------------------------- reading W&B's record file


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue it
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def wandb_runs(run_dir: Path) -> list[Path]:
    """The run files, once W&B's service has finished writing them (it may still flush after `finish`
    returns on a loaded machine): each file's size unchanged for 1 s, 30 s at most."""
    import time

    deadline, last = time.monotonic() + 30, None
    while True:
        files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        sizes = [f.stat().st_size for f in files]
        if sizes == last or time.monotonic() > deadline:
            return files
        last = sizes
        time.sleep(1.0)


def wandb_history(files: list[Path]) -> list[dict]:
    rows = []
    for f in files:
        for r in wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def wandb_of(files: list[Path], kind: str) -> list:
    return [getattr(r, kind) for f in files for r in wandb_records(f) if r.WhichOneof("record_type") == kind]


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers.json").read_text())
    return MlflowClient(tracking_uri=state["mlflow"]["uri"]), state["mlflow"]["run_id"]


# ----------------------------------------------------------------------------- config


def test_trackers_default_and_tensorboard_alias() -> None:
    assert LogConfig().trackers == ["tensorboard"] and LogConfig().tensorboard is True
    assert LogConfig(tensorboard=False).trackers == []  # the old switch still works
    assert LogConfig(trackers=["wandb", "mlflow", "wandb"]).trackers == ["wandb", "mlflow"]
    assert LogConfig(trackers=["wandb"]).tensorboard is False
    assert LogConfig(trackers=["mlflow", "tensorboard"], tensorboard=True).tensorboard is True
    assert "tensorboard" not in LogConfig().model_dump()  # config.yaml records trackers only
    assert LogConfig.model_validate(LogConfig(trackers=["wandb"]).model_dump()).trackers == ["wandb"]


def test_tracker_config_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown tracker 'wandbb'; did you mean 'wandb'"):
        LogConfig(trackers=["wandbb"])
    with pytest.raises(ValueError, match="log.tensorboard is true but log.trackers is \\['mlflow'\\]"):
        LogConfig(trackers=["mlflow"], tensorboard=True)


def test_missing_package_is_an_error_before_any_row(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(TrackerError, match=r"'wandb' but its package cannot be imported.*adarl\[tracking\]"):
        check_trackers(["tensorboard", "wandb"])
    with pytest.raises(TrackerError, match="wandb"):
        MetricsWriter(tmp_path / "run", tensorboard=False, trackers=["mlflow", "wandb"], config=recipe_dict())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    check_trackers(["tensorboard", "mlflow"])  # the others are fine


def test_mlflow_refuses_a_server_uri(tmp_path) -> None:
    with pytest.raises(TrackerError, match="log.mlflow_uri: 'http://localhost:5000' is not a local store"):
        check_trackers(["mlflow"], {"log": {"mlflow_uri": "http://localhost:5000"}})
    sqlite = {"log": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db"}}
    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny: the file store only
        with pytest.raises(TrackerError, match="needs the full mlflow package"):
            check_trackers(["mlflow"], sqlite)
    else:
        check_trackers(["mlflow"], sqlite)
    assert tracking.mlflow_uri(None, tmp_path) == (tmp_path.resolve() / "mlruns").as_uri()
    assert tracking.mlflow_uri(str(tmp_path / "store"), ".") == (tmp_path / "store").resolve().as_uri()


def test_names_and_params_flatten() -> None:
    assert mlflow_name("eval/pass@1") == "eval.pass_at_1"
    assert mlflow_name("reward/<lambda>") == "reward._lambda_"
    assert mlflow_name("/a//b/") == "a.b"
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": "x", "f": {}}) == {
        "a.b": "1", "a.c": "[1, 2]", "d": "null", "e": "x", "f": "{}"}


# ----------------------------------------------------------------------------- W&B


@pytest.mark.heavy
def test_wandb_offline_gets_rows_recipe_and_report(tmp_path) -> None:
    run = tmp_path / "run"
    with MetricsWriter(run, tensorboard=False, trackers=["wandb"], config=recipe_dict()) as w:
        for row in ROWS:
            w.write(row)
        (run / "report.html").write_text("<p>report</p>")
        w.log_artifact(run / "report.html")
    files = wandb_runs(run)
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert not list(run.glob("mlruns"))  # only the tracker asked for
    history = wandb_history(files)
    assert [h["_step"] for h in history] == [1, 2]
    # step 1: the numbers, nested dicts joined with '/'; the list, the text and the NaN are skipped
    assert {k: v for k, v in history[0].items() if not k.startswith("_")} == {
        "reward": 0.25, "reward/math": 1.0, "pass_rate": 0.5, "eval/pass@1": 0.4, "by_level/1": 1.0,
        "by_level/2": 0.0}
    assert {k: v for k, v in history[1].items() if not k.startswith("_")} == {"reward": 0.75, "pass_rate": 1.0}
    (run_record,) = wandb_of(files, "run")
    config = {i.key: json.loads(i.value_json) for c in wandb_of(files, "config") for i in c.update}
    config.update({i.key: json.loads(i.value_json) for i in run_record.config.update})
    assert run_record.project == "adarl" and run_record.run_id == json.loads((run / "trackers.json").read_text())[
        "wandb"]["run_id"]
    assert config["name"] == "tiny" and config["task"]["name"] == "basic_arithmetic"
    (artifact,) = wandb_of(files, "artifact")
    assert artifact.type == "report" and [m.path for m in artifact.manifest.contents] == ["report.html"]


@pytest.mark.heavy
def test_wandb_project_setting(tmp_path) -> None:
    run = tmp_path / "run"
    with MetricsWriter(run, tensorboard=False, trackers=["wandb"], config=recipe_dict(project="arith")) as w:
        w.write({"step": 1, "reward": 1.0})
    (run_record,) = wandb_of(wandb_runs(run), "run")
    assert run_record.project == "arith" and run_record.display_name == "run"


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_local_store_gets_rows_params_and_report(tmp_path) -> None:
    run = tmp_path / "run"
    with MetricsWriter(run, tensorboard=False, trackers=["mlflow"], config=recipe_dict()) as w:
        for row in ROWS:
            w.write(row)
    (run / "report.html").write_text("<p>report</p>")
    w.log_artifact(run / "report.html")  # after close: the stored run is reopened for it
    assert (run / "mlruns").is_dir()
    client, run_id = mlflow_client(run)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    assert client.get_experiment(got.info.experiment_id).name == "adarl"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")] == [(1, 0.25), (2, 0.75)]
    # `reward` beside `reward/math`: a file and a folder of one name in the file store, were '/' kept
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward.math")] == [(1, 1.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval.pass_at_1")] == [(1, 0.4)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "by_level.2")] == [(1, 0.0)]
    assert set(got.data.metrics) == {"reward", "reward.math", "pass_rate", "eval.pass_at_1", "by_level.1",
                                     "by_level.2"}
    params = got.data.params
    assert params["name"] == "tiny" and params["task.name"] == "basic_arithmetic"
    assert params["log.trackers"] == '["wandb", "mlflow"]'
    assert {a.path for a in client.list_artifacts(run_id)} == {"report.html", "recipe.json"}


def test_mlflow_store_path_setting(tmp_path) -> None:
    store = tmp_path / "shared-store"
    config = recipe_dict(mlflow_uri=str(store), project="arith")
    with MetricsWriter(tmp_path / "a", tensorboard=False, trackers=["mlflow"], config=config) as w:
        w.write({"step": 1, "reward": 1.0})
    with MetricsWriter(tmp_path / "b", tensorboard=False, trackers=["mlflow"], config=config) as w:
        w.write({"step": 1, "reward": 0.0})
    client, _ = mlflow_client(tmp_path / "b")
    experiment = client.get_experiment_by_name("arith")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["a", "b"] and not (tmp_path / "a" / "mlruns").exists()


# ----------------------------------------------------------------------------- both, resume, failures


@pytest.mark.heavy
def test_resume_continues_the_same_runs(tmp_path) -> None:
    run = tmp_path / "run"
    config = recipe_dict()
    with MetricsWriter(run, tensorboard=False, trackers=["wandb", "mlflow"], config=config) as w:
        for step in (1, 2, 3):
            w.write({"step": step, "reward": step / 10})
    ids = json.loads((run / "trackers.json").read_text())
    # killed after step 3, resumed from the step-2 checkpoint: step 3 is redone, then step 4
    with MetricsWriter(run, tensorboard=False, trackers=["wandb", "mlflow"], config=config, resume_step=2) as w:
        w.write({"step": 3, "reward": 0.3})
        w.write({"step": 4, "reward": 0.4})
    assert json.loads((run / "trackers.json").read_text()) == ids
    files = wandb_runs(run)
    assert len(files) == 2  # one offline directory per attempt, both of the same W&B run
    assert {r.run_id for r in wandb_of(files, "run")} == {ids["wandb"]["run_id"]}
    assert [h["_step"] for h in wandb_history(files)] == [1, 2, 3, 3, 4]
    client, run_id = mlflow_client(run)
    assert run_id == ids["mlflow"]["run_id"]
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1
    # MLflow keeps both points of the redone step
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1, 2, 3, 3, 4]
    assert client.get_run(run_id).info.status == "FINISHED"
    # a run that starts over (resume_step=-1) opens new runs
    MetricsWriter(run, tensorboard=False, trackers=["wandb", "mlflow"], config=config, resume_step=-1).close()
    fresh = json.loads((run / "trackers.json").read_text())
    assert fresh["wandb"]["run_id"] != ids["wandb"]["run_id"] and fresh["mlflow"]["run_id"] != run_id


def test_a_tracker_failing_mid_run_is_switched_off(tmp_path, monkeypatch, caplog) -> None:
    calls = []

    class Broken:
        def log(self, metrics, step):
            calls.append(step)
            raise OSError("disk full")

        def log_artifact(self, path):
            raise AssertionError("switched off: never called")

        def close(self):
            calls.append("closed")

    monkeypatch.setattr(tracking, "start_trackers", lambda *a, **k: {"broken": Broken()})
    with MetricsWriter(tmp_path, tensorboard=False, trackers=["wandb"]) as w:
        w.write({"step": 1, "reward": 1.0})
        w.write({"step": 2, "reward": 0.5})
        w.log_artifact(tmp_path / "metrics.jsonl")
    assert calls == [1, "closed"]
    assert "broken failed at step 1 and is switched off" in caplog.text
    assert [r["step"] for r in MetricsWriter.read(tmp_path)] == [1, 2]


def test_start_failure_closes_the_started_ones(tmp_path, monkeypatch) -> None:
    closed = []

    class Fine:
        run_id, uri = "x", "file:///nowhere"

        def __init__(self, *a, **k):
            pass

        def close(self):
            closed.append("wandb")

    def fail(*a, **k):
        raise RuntimeError("store locked")

    monkeypatch.setattr(tracking, "WandbTracker", Fine)
    monkeypatch.setattr(tracking, "MlflowTracker", fail)
    with pytest.raises(TrackerError, match="'mlflow' failed to start: RuntimeError\\('store locked'\\)"):
        tracking.start_trackers(["wandb", "mlflow"], tmp_path, recipe_dict())
    assert closed == ["wandb"] and not (tmp_path / "trackers.json").exists()


def test_tensorboard_named_in_trackers(tmp_path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False, trackers=["tensorboard"]) as w:
        w.write({"step": 1, "reward": 1.0})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "trackers.json").exists()


def test_trainer_logs_every_row_and_the_report(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """End to end: a real run writes its rows, recipe and report to W&B (offline) and MLflow."""
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 2},
                       allocate={"name": "fixed", "n": 3}, eval={"every": 0, "at_start": True},
                       log={"trackers": ["wandb", "mlflow"], "tensorboard": False, "progress": False})
    run = tmp_path / "run"
    Trainer(load_recipe(data=data), run).run()
    client, run_id = mlflow_client(run)
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1, 2, 3]
    assert len(client.get_metric_history(run_id, "eval.pass_at_1")) == 2  # at start and at the end
    assert "report.html" in [a.path for a in client.list_artifacts(run_id)]
    history = wandb_history(wandb_runs(run))
    assert [h["_step"] for h in history if "reward" in h] == [1, 2, 3]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["reward"] for h in history if "reward" in h] == [r["reward"] for r in rows if "reward" in r]
    assert not (run / "tb").exists()  # tensorboard was not asked for

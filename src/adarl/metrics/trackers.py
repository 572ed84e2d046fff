"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases (offline) and MLflow (a local store).

``log.trackers`` names them (TensorBoard, the third, lives in `adarl.metrics.sinks`). Both write
only under the run directory unless told otherwise, and neither touches the network:

- ``wandb``: an offline run (``run_dir/wandb/offline-run-*``), project ``log.project``; upload it
  later with ``wandb sync run_dir/wandb/offline-run-*``.
- ``mlflow``: a run in experiment ``log.project`` of the store ``log.mlflow_uri`` (default: a file
  store in ``run_dir/mlruns``; another local path, or a ``sqlite:`` URI with the full ``mlflow``
  package). Browse it with ``mlflow ui --backend-store-uri <uri>`` (the full package too).

Each gets the resolved recipe (W&B config; MLflow params, flattened with dots, and ``recipe.json``),
every row's finite numbers (nested dicts joined with '/'; lists such as histograms are skipped;
MLflow's names have '.' for '/' and '_at_' for '@', so ``eval/pass@1`` is ``eval.pass_at_1`` there),
and the report as an artifact. The run ids are kept in ``run_dir/trackers.json``, so a resumed
run continues the same W&B and MLflow runs (after `read_state` checks the file: known trackers, sane
run ids, and the store the recipe sets, so a tampered file cannot point MLflow at a server). A
tracker whose package is missing or whose setting is bad is an error when the writer starts
(`check_trackers` says so before any model loads); one that fails mid-run is switched off with a
warning, never stopping training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from adarl.config import TRACKERS

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
DEFAULT_PROJECT = "adarl"
INSTALL_HINT = "pip install 'adarl[tracking]'"
_PACKAGE = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it imports


class TrackerError(RuntimeError):
    """A tracker cannot start: its package is missing or a setting is bad."""


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def close(self) -> None: ...


def settings_of(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tracker settings (``project``, ``mlflow_uri``) in a resolved recipe's ``log`` section."""
    section = (config or {}).get("log") or {}
    return {"project": section.get("project") or DEFAULT_PROJECT, "mlflow_uri": section.get("mlflow_uri")}


def mlflow_uri(uri: str | None, run_dir: str | Path) -> str:
    """The MLflow store URI: ``run_dir/mlruns`` by default; only local stores (a path, file:, sqlite:)."""
    if not uri:
        return (Path(run_dir).resolve() / "mlruns").as_uri()
    scheme = uri.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) else ""
    if scheme in ("", "file"):
        return uri if scheme else Path(uri).expanduser().resolve().as_uri()
    if scheme == "sqlite":
        return uri
    raise TrackerError(f"log.mlflow_uri: '{uri}' is not a local store; adarl logs only to a path, a file: "
                       "or a sqlite: URI (e.g. sqlite:///runs/mlflow.db), never to a server over the network")


def check_trackers(trackers: Sequence[str], config: Mapping[str, Any] | None = None) -> None:
    """Raise TrackerError now if a tracker of `trackers` could not start (call it before loading a model).

    It imports each tracker's package (a broken install fails here, not mid-run) and checks its settings
    in `config` (the resolved recipe, or just its ``log`` section under ``"log"``).
    """
    settings = settings_of(config)
    for name in trackers:
        if name == "tensorboard":
            continue
        if name not in _PACKAGE:
            raise TrackerError(f"log.trackers: unknown tracker '{name}' (choices: {', '.join(TRACKERS)})")
        try:
            __import__(_PACKAGE[name])
        except Exception as err:  # ImportError, or a broken install failing at import
            raise TrackerError(f"log.trackers names '{name}' but its package cannot be imported ({err}); "
                               f"install it ({INSTALL_HINT}) or remove '{name}' from log.trackers") from None
        if name == "mlflow":
            uri = mlflow_uri(settings["mlflow_uri"], ".")
            if uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
                raise TrackerError(f"log.mlflow_uri: '{uri}' needs the full mlflow package (pip install mlflow); "
                                   "mlflow-skinny has only the file store (leave log.mlflow_uri unset or give a path)")


MAX_STATE_BYTES = 64 * 1024  # trackers.json holds two short entries; a larger one is not adarl's
_STATE_KEYS = {"wandb": {"run_id"}, "mlflow": {"run_id", "uri"}}  # tracker -> the keys its entry may have
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # W&B: 8 hex digits here; MLflow: 32


def read_state(run_dir: str | Path, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tracker runs ``run_dir/trackers.json`` names, checked before any is used; {} with no file.

    A resumed run reads this file, so it is foreign data: only known trackers, run ids of a sane shape,
    and an MLflow store equal to the one `config` (the resolved recipe) sets, or TrackerError. It is an
    error rather than a warning and new tracker runs: adarl writes this file itself, so a bad one means a
    tampered file or a changed setting, and silently starting new runs would split the run's history.
    """
    path = Path(run_dir) / STATE_FILE

    def bad(what: str) -> TrackerError:
        return TrackerError(f"{path}: {what}; this file names the tracker runs a resumed run continues: "
                            "delete it to start new tracker runs (or undo the change to log.mlflow_uri)")

    try:
        with path.open("rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise bad(f"cannot be read ({err.strerror or err})") from None
    if len(data) > MAX_STATE_BYTES:
        raise bad(f"larger than {MAX_STATE_BYTES} bytes")
    try:
        state = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise bad(f"not valid JSON ({printable(str(err))})") from None
    if not isinstance(state, dict):
        raise bad(f"expected an object of tracker runs, got {type(state).__name__}")
    for name, entry in state.items():
        if name not in _STATE_KEYS:
            raise bad(f"unknown tracker {printable(name)!r} (expected {' or '.join(_STATE_KEYS)})")
        if not isinstance(entry, dict):
            raise bad(f"{name}: expected an object, got {type(entry).__name__}")
        unknown = [k for k in entry if k not in _STATE_KEYS[name]]
        if unknown:
            expected_keys = ", ".join(sorted(_STATE_KEYS[name]))
            raise bad(f"{name}: unknown key {printable(unknown[0])!r} (expected {expected_keys})")
        run_id = entry.get("run_id")
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            raise bad(f"{name}: run_id must be 1 to 64 letters, digits, '_' or '-', got {printable(run_id)}")
        if "uri" in entry:
            expected = mlflow_uri(settings_of(config)["mlflow_uri"], run_dir)
            if entry["uri"] != expected:
                raise bad(f"{name}: store {printable(entry['uri'])} is not the one the recipe sets ({expected})")
    return state


def printable(value: object, limit: int = 80) -> str:
    """`value` for an error message: repr'd, ASCII, at most `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    os.replace(tmp, run_dir / STATE_FILE)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested recipe as ``{"a.b.c": "value"}`` strings (lists and None as JSON), for MLflow params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return out


def mlflow_name(tag: str) -> str:
    """A metric or param name MLflow accepts: ``eval/pass@1`` -> ``eval.pass_at_1``.

    '/' becomes '.': MLflow's file store keeps a name as a file path, so ``reward`` beside
    ``reward/math`` would be a file and a folder of one name.
    """
    name = re.sub(r"[^\w.\- :]", "_", tag.replace("@", "_at_").replace("/", "."))
    return re.sub(r"\.{2,}", ".", name).strip(".") or "_"


class WandbTracker:
    """One offline W&B run under ``run_dir/wandb``; `run_id` continues an earlier one."""

    def __init__(self, run_dir: Path, project: str, config: Mapping[str, Any] | None, run_id: str | None) -> None:
        import wandb

        settings = wandb.Settings(mode="offline", console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True)
        self.run_id = run_id or secrets.token_hex(4)
        # wandb's core resolves a relative dir elsewhere and then writes an empty run file: pass it absolute
        self.run = wandb.init(project=project, dir=str(run_dir.resolve()), id=self.run_id, name=run_dir.name,
                              resume="allow", reinit="create_new", settings=settings)
        if config is not None:
            self.run.config.update(dict(config), allow_val_change=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_artifact(self, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{re.sub(r'[^A-Za-z0-9._-]', '_', path.stem)}-{self.run_id}", type="report")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run of experiment `project` in the local store `uri`; `run_id` continues an earlier one."""

    def __init__(self, run_dir: Path, project: str, uri: str, config: Mapping[str, Any] | None,
                 run_id: str | None) -> None:
        if uri.startswith("file:"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses its file store without it
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                            tags={"adarl.run_dir": str(run_dir.resolve())}).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        if config is not None:
            have = self.client.get_run(run_id).data.params
            params = {}
            for key, value in flatten(config).items():
                name, value = mlflow_name(key)[:250], value[:6000]
                if name in have and have[name] != value:  # MLflow never changes a param: a resume override
                    log.warning("mlflow: param %s changed on resume (%r -> %r); recipe.json has the new value",
                                name, have[name], value)
                elif name not in have:
                    params[name] = value
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow's batch limit
                self.client.log_batch(run_id, params=items[i:i + 100])
            self.client.log_dict(run_id, dict(config), "recipe.json")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def start_trackers(names: Sequence[str], run_dir: str | Path, config: Mapping[str, Any] | None = None,
                   resume: bool = False, log_recipe: bool = True) -> dict[str, Tracker]:
    """Start the trackers `names` (TensorBoard aside) for `run_dir`, continuing its stored runs if `resume`.

    `config` is the resolved recipe: its ``log`` section holds the settings, and the whole of it is logged
    unless `log_recipe` is false. A tracker that cannot start raises TrackerError (after closing the others).
    """
    run_dir = Path(run_dir)
    wanted = [n for n in dict.fromkeys(names) if n != "tensorboard"]
    if not wanted:
        return {}
    check_trackers(wanted, config)
    settings = settings_of(config)
    recipe = config if log_recipe else None
    state = read_state(run_dir, config) if resume else {}  # checked before any tracker starts
    started: dict[str, Tracker] = {}
    name = wanted[0]
    try:
        for name in wanted:
            previous = (state.get(name) or {}) if resume else {}
            if name == "wandb":
                started[name] = tracker = WandbTracker(run_dir, settings["project"], recipe, previous.get("run_id"))
            else:
                uri = mlflow_uri(settings["mlflow_uri"], run_dir)  # read_state: the stored one is this
                started[name] = tracker = MlflowTracker(run_dir, settings["project"], uri, recipe,
                                                        previous.get("run_id"))
            state[name] = {"run_id": tracker.run_id, **({"uri": tracker.uri} if name == "mlflow" else {})}
    except Exception as err:
        close_trackers(started)
        if isinstance(err, TrackerError):
            raise
        raise TrackerError(f"log.trackers: '{name}' failed to start: {err!r}") from err
    _write_state(run_dir, state)
    return started


def close_trackers(trackers: Mapping[str, Tracker]) -> None:
    for name, tracker in trackers.items():
        try:
            tracker.close()
        except Exception as err:  # closing must not hide the error that got us here
            log.warning("%s: could not close: %r", name, err)


def log_artifact_later(names: Sequence[str], run_dir: str | Path, path: str | Path,
                       config: Mapping[str, Any] | None = None) -> None:
    """Add `path` as an artifact to the runs `run_dir/trackers.json` names, reopening them for it."""
    stored = read_state(run_dir, config)
    trackers = start_trackers([n for n in names if n in stored], run_dir, config, resume=True, log_recipe=False)
    try:
        for tracker in trackers.values():
            tracker.log_artifact(Path(path))
    finally:
        close_trackers(trackers)

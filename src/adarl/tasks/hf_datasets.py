"""Problems from a Hugging Face dataset: parquet, json/jsonl, csv or arrow files, a folder, or a Hub id.

``task.path`` is a data file (read with the `datasets` builder its extension names), a folder that
``save_to_disk`` wrote (a Dataset or a DatasetDict), a folder of data files (``train.parquet``,
``test.parquet``, ... become splits), or a Hub dataset id (``openai/gsm8k``): its snapshot in the
Hugging Face cache, downloaded only when not cached and ``HF_HUB_OFFLINE`` is unset (`adarl.hub`),
then read as a local folder. ``task.config`` picks a subset of a folder or snapshot: its subfolder
(GSM8K's ``main/train-00000-of-00001.parquet``), else a config its README declares. `datasets`
itself always runs offline (``HF_DATASETS_OFFLINE=1``).

``task.split`` picks the split to train on (a single file is split ``train``); left unset, the data
must have one split. Rows become problems exactly as the lines of a JSONL task do
(`adarl.tasks.jsonl`): ``task.fields`` maps ``id``/``prompt``/``answer`` to columns, the prompt is a
string or a list of chat messages (TRL's conversational format), every other column reaches the
rewards (``Problem.columns``), and a bad row stops the load unless ``task.skip_bad_lines``. A
mapping to a column the data lacks is an error naming the columns it has.

Eval is ``task.eval_split`` of the same data, or ``task.eval_path`` (read the same way, same
``split``), at most ``eval_size`` problems; otherwise ``eval_size`` problems are held out at random by
`adarl.tasks.base.split_held_out`. Eval ids and prompts never stay in training.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path
from typing import Any

from adarl import hub
from adarl.config import TaskConfig
from adarl.metrics.sinks import to_jsonable
from adarl.tasks import guard
from adarl.tasks.base import TaskSource, dedupe, remove_held, split_held_out
from adarl.tasks.jsonl import DEFAULT_FIELDS, BadLines, _problem, field_map
from adarl.types import Problem

log = logging.getLogger(__name__)

BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


def _offline():
    """The `datasets` module, told never to reach the Hub (set before and after its import); a Hub id's
    snapshot is fetched by `adarl.hub` before `datasets` reads it."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise ValueError("task.source 'hf_datasets' needs the `datasets` package: pip install datasets") from None
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def locate(path: str | Path, config: str | None, key: str = "task.path") -> tuple[Path, str | None]:
    """The local file or folder to read for `path` (a Hub id: its cached snapshot) and `config`: the
    config's subfolder when there is one, else the folder and the config name for `datasets`."""
    try:
        p = hub.snapshot(str(path), "dataset", key) if hub.is_hub_id(str(path)) else Path(path).expanduser()
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    if not p.exists():
        raise ValueError(f"task data not found: {path} (source 'hf_datasets' reads a local data file or folder, "
                         "or a Hub dataset id org/name)")
    if config is None:
        return p, None
    if not p.is_dir():
        raise ValueError(f"task.config '{config}': {path} is one file, not a dataset with configs; remove task.config")
    return (p / config, None) if (p / config).is_dir() else (p, config)


def load_local(path: str | Path, config: str | None = None, key: str = "task.path",
               max_file_mb: float = TaskConfig.model_fields["max_file_mb"].default) -> Any:
    """The Dataset or DatasetDict at `path` (a local file or folder, or a Hub id), of `config` when given;
    ValueError if it is not a readable dataset, or fails a check of `tasks.guard` (size, JSON depth,
    parquet decompression) that runs before `datasets` reads a byte of it."""
    p, name = locate(path, config, key)
    builder = None if p.is_dir() else BUILDERS.get(p.suffix.lower())
    if not p.is_dir() and builder is None:
        raise ValueError(f"{path}: cannot read a '{p.suffix}' file as a dataset (extensions: "
                         f"{', '.join(BUILDERS)}; or a folder that save_to_disk wrote)")
    guard.check_data(p, max_file_mb, path)
    datasets = _offline()
    cache = os.environ.get("HF_DATASETS_CACHE") or None  # read now: `datasets` read it at import
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if builder is not None:
            return datasets.load_dataset(builder, data_files=str(p.resolve()), cache_dir=cache)
        if name is None and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):  # save_to_disk
            return datasets.load_from_disk(str(p))
        return datasets.load_dataset(str(p.resolve()), **({"name": name} if name else {}), cache_dir=cache)
    except Exception as err:  # the library's own errors (a torn parquet file, a CSV that does not parse)
        hint = ""
        if name is not None:
            folders = sorted(q.name for q in p.iterdir() if q.is_dir() and not q.name.startswith("."))
            hint = (f" (task.config '{name}' is neither a subfolder of {p} nor a config its README declares; "
                    f"its subfolders: {', '.join(folders) or 'none'})")
        cause = err.__cause__ or err.__context__  # DatasetGenerationError hides pyarrow's reason here
        why = f" ({type(cause).__name__}: {str(cause)[:300]})" if cause is not None else ""
        raise ValueError(f"{path}: not readable as a dataset{hint}: {type(err).__name__}: {err}{why}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()


def pick_split(data: Any, split: str | None, path: str | Path, key: str = "task.split") -> Any:
    """One split of `data` (a Dataset is its own only split); a wrong or missing name lists the splits."""
    if not isinstance(data, dict):  # a Dataset; a DatasetDict is a dict of them
        if split is not None and split != (str(data.split) if data.split is not None else None):
            raise ValueError(f"{key}: {path} is one dataset, not split into named splits; remove {key}")
        return data
    names = sorted(data.keys())
    if split is None:
        if len(names) == 1:
            return data[names[0]]
        raise ValueError(f"{key}: {path} has the splits {', '.join(names)}; name the one to use")
    if split not in data:
        close = difflib.get_close_matches(split, names, n=1, cutoff=0.4)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"{key}: {path} has no split '{split}'{hint} (its splits: {', '.join(names)})")
    return data[split]


def _check_fields(columns: list[str], fields: dict[str, str], where: str) -> None:
    """The prompt's column and every mapping the user changed must be columns of the data.

    As in a JSONL file, ``id`` and ``answer`` left at their defaults are optional (a content-hash id, no answer).
    """
    for role, key in fields.items():
        if key in columns or (role != "prompt" and key == DEFAULT_FIELDS[role]):
            continue
        close = difflib.get_close_matches(key, columns, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"task.fields.{role}: {where} has no column '{key}'{hint} "
                         f"(its columns: {', '.join(columns[:30])})")


def read_split(rows: Any, cfg: TaskConfig, where: str, bad: BadLines | None = None) -> list[Problem]:
    """Every problem of one split, in row order (duplicates kept); bad rows as `read_jsonl` treats lines."""
    fields = field_map(cfg)
    _check_fields(list(rows.column_names), fields, where)
    rows = _text_columns(rows, fields, where)
    max_row = int(cfg.max_row_mb * (1 << 20))
    skipped = BadLines()
    problems = []
    for n, raw in enumerate(_rows(rows, where), start=1):
        row = to_jsonable(raw)  # numpy values, NaN (a CSV's empty cell) -> plain JSON, None
        try:
            line = json.dumps(row, ensure_ascii=False)
            if len(line) > max_row:
                raise ValueError(f"{where}, row {n}: the row is over {guard.mib(max_row)} of text, more than "
                                 f"task.max_row_mb ({cfg.max_row_mb:g}) allows")
            problems.append(_problem(row, cfg, fields, f"{where}, row {n}", line))
        except ValueError as err:
            if not cfg.skip_bad_lines:
                raise ValueError(f"{err} (set task.skip_bad_lines: true to skip bad rows)") from None
            skipped.add(str(err))
    total = len(problems) + skipped.count
    skipped.settle(where, total, len(problems), cfg, bad, unit="row")
    if not problems:
        raise ValueError(f"{where}: no rows (the split is empty)")
    return problems


def _text_columns(rows: Any, fields: dict[str, str], where: str) -> Any:
    """`rows` without its binary, image, audio or video columns, none of them decoded (an image bomb is
    never opened); ValueError if the prompt, answer or id is such a column (text is required there)."""
    features = getattr(rows, "features", None) or {}
    binary = {name: kind for name, f in features.items() if (kind := guard.binary_kind(f))}
    for role, key in fields.items():
        if key in binary:
            raise ValueError(f"task.fields.{role}: {where}: column '{key}' holds {binary[key]} data, not text; "
                             "map the role to a text column")
    if binary:
        log.warning("%s: columns %s hold binary data (%s), not text: left out of the problems' columns",
                    where, ", ".join(sorted(binary)), ", ".join(sorted(set(binary.values()))))
        rows = rows.remove_columns(sorted(binary))
    return rows


def _rows(rows: Any, where: str) -> Any:
    """The rows of a split; an error the library raises reading one (a string that is not UTF-8, a torn
    file) is one ValueError naming the row."""
    n = 0
    it = iter(rows)
    while True:
        n += 1
        try:
            yield next(it)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001 - pyarrow's and datasets' own errors, on data we did not write
            raise ValueError(f"{where}, row {n}: not readable: {type(err).__name__}: {str(err)[:200]}") from None


def _where(path: str | Path, split: str | None) -> str:
    return f"{path} [{split}]" if split else str(path)


def load_hf_datasets(cfg: TaskConfig, data_seed: int) -> TaskSource:
    """Training and eval problems from `cfg.path` (its `cfg.split`), and `cfg.eval_split` or `cfg.eval_path`."""
    if not cfg.path:
        raise ValueError("task.path is required for source 'hf_datasets'")
    if cfg.eval_split and cfg.eval_path:
        raise ValueError("task.eval_split and task.eval_path both name the held-out problems; keep one")
    bad = BadLines()
    data = load_local(cfg.path, cfg.config, max_file_mb=cfg.max_file_mb)
    problems = read_split(pick_split(data, cfg.split, cfg.path), cfg, _where(cfg.path, cfg.split), bad)
    unique = dedupe(problems)
    if len(unique) < len(problems):
        log.info("%s: %d rows repeat an earlier id and were merged", cfg.path, len(problems) - len(unique))
    held: list[Problem] | None = None
    if cfg.eval_split:
        if cfg.eval_split == cfg.split:
            raise ValueError(f"task.eval_split is the training split '{cfg.split}'; name another split")
        rows = pick_split(data, cfg.eval_split, cfg.path, key="task.eval_split")
        held = dedupe(read_split(rows, cfg, _where(cfg.path, cfg.eval_split), bad))[: cfg.eval_size]
        other = f"split '{cfg.eval_split}'"
    elif cfg.eval_path:
        data = load_local(cfg.eval_path, cfg.config, "task.eval_path", cfg.max_file_mb)
        rows = pick_split(data, cfg.split, cfg.eval_path)
        held = dedupe(read_split(rows, cfg, _where(cfg.eval_path, cfg.split), bad))[: cfg.eval_size]
        other = cfg.eval_path
    if held is not None:
        train = remove_held(unique, held)
        if not train:
            raise ValueError(f"{cfg.path}: every problem is also in the eval data ({other})")
        if len(train) < len(unique):
            log.info("%s: %d problems also in %s were removed from training", cfg.path, len(unique) - len(train), other)
    else:
        if "eval_size" not in cfg.model_fields_set and 2 * cfg.eval_size > len(unique):
            # as build_task does for a jsonl file: an unset eval_size on a small task holds out half
            log.info("%s has %d distinct problems: holding out %d (task.eval_size defaults to %d)",
                     cfg.path, len(unique), len(unique) // 2, cfg.eval_size)
            cfg.eval_size = len(unique) // 2
        if cfg.eval_size >= len(unique):
            raise ValueError(
                f"{cfg.path}: task.eval_size is {cfg.eval_size} but the data has only {len(unique)} distinct "
                "problems; at least one must be left for training (lower task.eval_size, or set task.eval_split "
                "or task.eval_path)")
        train, held = split_held_out(unique, cfg.eval_size, data_seed, what=str(cfg.path))
    p = Path(cfg.path).expanduser()
    return TaskSource(train=train, eval=held, name=p.stem if p.is_file() else p.name,
                      skipped=bad.count, first_bad=bad.first)

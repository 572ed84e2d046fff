"""What a task loader checks before it reads a data file it did not write: each check refuses with one
ValueError that names the file and the line, column or row (`tasks/jsonl.py`, `tasks/hf_datasets.py`).

- **size**: a file (or the data files of a folder) larger than ``task.max_file_mb``; a JSONL line or a
  dataset row larger than ``task.max_row_mb``.
- **depth**: JSON nested more than `MAX_JSON_DEPTH` levels. Python's parser raises RecursionError on a
  few thousand levels, but pyarrow's JSON reader (the `datasets` loader) crashes the process: a 200 KB
  file of 100,000 brackets segfaulted it. `json_depth` scans the bytes, strings skipped, without parsing.
- **decompression**: a parquet file whose row groups declare more than ``task.max_file_mb`` of data
  once decompressed, or more than `MAX_PARQUET_RATIO` times its compressed size.
- **binary where text is required**: a binary, image, audio or video column named by ``task.fields``;
  such columns are never decoded (so an image decompression bomb is never opened), and other columns
  of those kinds are left out of `Problem.columns` (they would reach hints and rewards as ``"b'...'"``).
- **invalid Unicode**: a lone surrogate (JSON allows ``"\\ud800"``) in any key or value of a row, since
  every column may become text (hints, teacher prompts, rewards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adarl.files import scan_depth

MAX_JSON_DEPTH = 64  # chat messages need 3; nothing a task reads needs more than a few
MAX_PARQUET_RATIO = 1000.0  # decompressed / compressed bytes; a constant column compresses ~100x
RATIO_FLOOR_BYTES = 64 << 20  # below this much decompressed data any ratio is harmless
JSON_SUFFIXES = (".json", ".jsonl")
DATA_SUFFIXES = (".parquet", ".json", ".jsonl", ".csv", ".arrow")
_CHUNK = 1 << 22


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def check_file_size(path: Path, max_mb: float, shown: str | Path | None = None) -> int:
    """The size of `path` in bytes; ValueError if it is over `max_mb` MiB (task.max_file_mb)."""
    size = path.stat().st_size
    if size > max_mb * (1 << 20):
        raise ValueError(f"{shown or path}: the file is {mib(size)}, more than task.max_file_mb ({max_mb:g} MiB) "
                         "allows; raise task.max_file_mb if it is trusted")
    return size


def json_depth(path: Path, limit: int = MAX_JSON_DEPTH) -> tuple[int, int, int] | None:
    """(line, column, depth) of the first bracket nested deeper than `limit` in the JSON text of `path`
    (brackets inside strings do not count), or None. Reads the file in chunks; parses nothing."""
    with path.open("rb") as f:
        return scan_depth(iter(lambda: f.read(_CHUNK), b""), limit)


def check_json_depth(path: Path, shown: str | Path | None = None) -> None:
    """ValueError naming the line and column where `path`'s JSON nests deeper than `MAX_JSON_DEPTH`."""
    if (deep := json_depth(path)) is not None:
        line, column, _ = deep
        raise ValueError(f"{shown or path}, line {line}, column {column}: JSON nested more than {MAX_JSON_DEPTH} "
                         "levels deep; a task's rows need a few (chat messages: 3)")


def check_parquet(path: Path, max_mb: float, shown: str | Path | None = None) -> None:
    """ValueError if the parquet file at `path` declares more decompressed data than `max_mb` MiB, or a
    decompression ratio above `MAX_PARQUET_RATIO` (over `RATIO_FLOOR_BYTES`); read from its footer only."""
    import pyarrow.parquet as pq

    where = shown or path
    try:
        meta = pq.ParquetFile(path).metadata
        full = sum(max(meta.row_group(i).total_byte_size, 0) for i in range(meta.num_row_groups))
        packed = sum(max(meta.row_group(i).column(j).total_compressed_size, 0)
                     for i in range(meta.num_row_groups) for j in range(meta.num_columns))
        uncompressed = sum(max(meta.row_group(i).column(j).total_uncompressed_size, 0)
                           for i in range(meta.num_row_groups) for j in range(meta.num_columns))
    except Exception as err:  # a torn or forged footer: pyarrow's own error, one line
        why = f"{type(err).__name__}: {str(err)[:200]}"
        raise ValueError(f"{where}: not readable as a dataset (its parquet footer): {why}") from None
    full = max(full, uncompressed)
    if full > max_mb * (1 << 20):
        raise ValueError(f"{where}: the parquet data decompresses to {mib(full)}, more than task.max_file_mb "
                         f"({max_mb:g} MiB) allows (a decompression bomb?); raise task.max_file_mb if it is trusted")
    ratio = full / max(packed, 1)
    if full > RATIO_FLOOR_BYTES and ratio > MAX_PARQUET_RATIO:
        raise ValueError(f"{where}: the parquet data decompresses {ratio:.0f} times ({mib(packed)} to {mib(full)}), "
                         f"more than {MAX_PARQUET_RATIO:g} times (a decompression bomb?)")


def data_files(p: Path) -> list[Path]:
    """The data files a loader would read at `p`: the file itself, or a folder's data files (recursively)."""
    if p.is_file():
        return [p]
    return sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in DATA_SUFFIXES
                  and not any(part.startswith(".") for part in q.relative_to(p).parts))


def check_data(p: Path, max_mb: float, shown: str | Path | None = None) -> None:
    """Every check a file or folder must pass before `datasets` reads it: total size, JSON depth, parquet
    decompression. Names the file (and line, column) that fails."""
    files = data_files(p)
    total = 0
    for f in files:
        name = f if p.is_dir() else (shown or f)
        total += check_file_size(f, max_mb, name)
        if f.suffix.lower() in JSON_SUFFIXES:
            check_json_depth(f, name)
        elif f.suffix.lower() == ".parquet":
            check_parquet(f, max_mb, name)
    if total > max_mb * (1 << 20):
        raise ValueError(f"{shown or p}: its data files hold {mib(total)}, more than task.max_file_mb "
                         f"({max_mb:g} MiB) allows; raise task.max_file_mb if it is trusted")


def bad_unicode(row: dict[str, Any]) -> str | None:
    """The first key of `row` whose name or value holds a lone surrogate (not encodable as UTF-8), or None."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    for key, value in row.items():
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return key
    return None


def binary_kind(feature: Any) -> str | None:
    """What non-text data a `datasets` feature holds ("binary", "image", "audio", "video", "pdf"), looking
    inside lists and structs; None for text, numbers and their containers."""
    kind = type(feature).__name__
    if kind in ("Image", "Audio", "Video", "Pdf", "Nifti"):
        return kind.lower()
    if kind == "Value":
        return "binary" if "binary" in str(getattr(feature, "dtype", "")) else None
    if isinstance(feature, dict):
        inner = [binary_kind(v) for v in feature.values()]
    elif isinstance(feature, (list, tuple)):
        inner = [binary_kind(v) for v in feature]
    else:
        inner = [binary_kind(getattr(feature, "feature", None))] if hasattr(feature, "feature") else []
    return next((k for k in inner if k), None)

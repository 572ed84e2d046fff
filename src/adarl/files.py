"""Crash-safe writes (a file or folder a killed process leaves either old or new, whole, never torn) and
bounded reads of files adarl did not necessarily write (below)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so a crash leaves either the old file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------- bounded reading of files adarl did not write
#
# A run directory is shared (a teacher, a checkpoint to resume, a comparison to report), so what it holds is
# untrusted: a FIFO that never ends, a link to /dev/zero, JSON nested 100,000 deep (a RecursionError), a
# 5,000-digit number (past Python's int parsing limit). Every run-directory file goes through these readers:
# regular files only, a size cap, a nesting cap, short numbers; each refusal is one UnsafeFile naming the file.

MAX_JSON_DEPTH = 64  # what adarl writes nests a few levels
MAX_NUMBER_CHARS = 64  # a float64 prints in at most 24; an int adarl writes in at most 20
MB = 1 << 20
_JSON_SPECIAL = re.compile(rb'[\[\]{}"\\\n]')


def scan_depth(chunks: Any, limit: int = MAX_JSON_DEPTH) -> tuple[int, int, int] | None:
    """(line, column, depth) of the first bracket nested deeper than `limit` in the JSON text made of these
    byte chunks (brackets inside strings do not count), or None; parses nothing (`tasks.guard.json_depth` reads a
    file's chunks through it)."""
    depth, line, line_start, pos = 0, 1, 0, 0
    in_string, skip = False, -1  # skip: the offset of a character escaped by a backslash
    for chunk in chunks:
        for m in _JSON_SPECIAL.finditer(chunk):
            at = pos + m.start()
            if at == skip:
                continue
            c = m.group()
            if c == b"\n":
                line, line_start = line + 1, at + 1
            elif in_string:
                if c == b"\\":
                    skip = at + 1
                elif c == b'"':
                    in_string = False
            elif c == b'"':
                in_string = True
            elif c in b"[{":
                depth += 1
                if depth > limit:
                    return line, at - line_start + 1, depth
            elif c in b"]}":
                depth = max(0, depth - 1)
        pos += len(chunk)
    return None


class UnsafeFile(ValueError):
    """A file adarl refuses to read: one line naming the file and why."""


def read_bytes_bounded(path: str | Path, max_bytes: int, shown: str | Path | None = None) -> bytes:
    """The bytes of `path`: a regular file (a link to one is followed) of at most `max_bytes`. A FIFO, device,
    socket or folder is refused before it is opened (a FIFO would block, /dev/zero never ends)."""
    import stat

    shown = shown or path
    try:
        st = os.stat(path)
    except OSError as err:
        raise UnsafeFile(f"{shown}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{shown}: not a regular file, so it is not read (a run directory holds regular files)")
    if st.st_size > max_bytes:
        raise UnsafeFile(f"{shown}: {st.st_size / MB:.1f} MiB, more than the {max_bytes / MB:g} MiB such a file may be")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        raise UnsafeFile(f"{shown}: cannot read it ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped between the stat and the open
            raise UnsafeFile(f"{shown}: not a regular file, so it is not read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFile(f"{shown}: grew past the {max_bytes / MB:g} MiB such a file may be while it was read")
    return data


def _number(kind: type) -> Any:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise _LongNumber(len(text))
        return kind(text)

    return parse


class _LongNumber(Exception):
    pass


def parse_json_bounded(text: str | bytes, shown: str | Path, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of text from `shown`, refusing nesting past `max_depth` (scanned before parsing, so no
    RecursionError) and numbers longer than `MAX_NUMBER_CHARS` characters, with one UnsafeFile naming it;
    invalid JSON raises json.JSONDecodeError as usual (callers decide whether a torn line is skipped)."""
    import json

    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    deep = scan_depth([raw], max_depth)
    if deep is not None:
        raise UnsafeFile(f"{shown}: JSON nested deeper than {max_depth} levels (line {deep[0]}, column {deep[1]})")
    try:
        return json.loads(raw, parse_int=_number(int), parse_float=_number(float))
    except _LongNumber as err:
        raise UnsafeFile(f"{shown}: a number of {err.args[0]} characters (at most {MAX_NUMBER_CHARS})") from None
    except RecursionError:  # unreachable after the scan; kept so a parser change cannot bring the traceback back
        raise UnsafeFile(f"{shown}: JSON nested too deep") from None


def read_json_bounded(path: str | Path, max_mb: float = 64, shown: str | Path | None = None,
                      invalid: Any = UnsafeFile) -> Any:
    """The JSON value of a file adarl did not necessarily write (see `read_bytes_bounded`, `parse_json_bounded`).
    Text that is not JSON (a torn write) is an UnsafeFile, or gives `invalid` when that is not UnsafeFile."""
    import json

    shown = shown or path
    data = read_bytes_bounded(path, int(max_mb * MB), shown)
    try:
        return parse_json_bounded(data, shown)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        if invalid is not UnsafeFile:
            return invalid
        raise UnsafeFile(f"{shown}: not valid JSON ({str(err).splitlines()[0][:200]})") from None


def read_jsonl_bounded(path: str | Path, max_mb: float = 1024, shown: str | Path | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file; a torn or non-object line is skipped (a crash can leave one), a
    hostile one (too deep, a too long number) is an UnsafeFile naming the file and line."""
    import json

    shown = shown or path
    rows = []
    data = read_bytes_bounded(path, int(max_mb * MB), shown)
    for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            row = parse_json_bounded(line, f"{shown}, line {i}")
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows

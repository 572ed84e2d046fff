"""Problems from a JSON-lines file, one object per line, with a held-out eval split.

``task.fields`` maps ``id``/``prompt``/``answer`` to the file's keys (keys left out keep
their defaults). The prompt is a string (rendered with the system prompt and template) or
a list of chat messages (used as given, after the system prompt if the list has none).
A line without the id key gets a content hash of its prompt; without the answer key, no
answer. ``task.answer_after`` keeps only the text after the last marker of the answer (GSM8K's
``... #### 72`` with ``answer_after: "####"`` gives ``72``). Every other key becomes a column.
Problems are unique by id: a repeated id keeps its first line.

Eval comes from ``task.eval_path`` when set (at most ``eval_size`` problems), otherwise
``eval_size`` distinct problems are held out at random (seeded) by the rule every source
shares, `adarl.tasks.base.split_held_out`. Either way, every problem whose id or prompt is in
eval is removed from training.

A bad line (not UTF-8, not JSON, not an object, no usable prompt, an id that is not a string
or an integer) is an error naming the file and line. With ``task.skip_bad_lines: true`` bad
lines are skipped instead: a warning gives their count and the first one, and
``TaskSource.skipped`` / ``TaskSource.first_bad`` carry them to the run's first metrics row.
If more than ``task.max_bad_fraction`` of a file's lines are bad, it is an error even then. A
UTF-8 byte-order mark at the start of the file is ignored.
"""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path
from typing import Any

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, dedupe, problem_id, remove_held, render_prompt, split_held_out
from adarl.tasks.guard import MAX_JSON_DEPTH, bad_unicode, check_file_size, mib, scan_depth
from adarl.types import Problem

log = logging.getLogger(__name__)

_SKIP = 1 << 20  # how much of an oversized line is read at a time, to skip it
FIELD_ROLES = ("id", "prompt", "answer")
DEFAULT_FIELDS = {role: role for role in FIELD_ROLES}


def field_map(cfg: TaskConfig) -> dict[str, str]:
    """`cfg.fields` merged over the defaults; an unknown role is an error with a hint."""
    for role in cfg.fields:
        if role not in FIELD_ROLES:
            close = difflib.get_close_matches(role, FIELD_ROLES, n=1, cutoff=0.4)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            roles = ", ".join(FIELD_ROLES)
            raise ValueError(f"task.fields.{role}: unknown field role{hint} (roles: {roles})")
    return {**DEFAULT_FIELDS, **cfg.fields}


def _snippet(line: str, width: int = 80) -> str:
    line = line.strip()
    return printable(repr(line if len(line) <= width else line[:width] + "..."))


def printable(text: str) -> str:
    """`text` with lone surrogates escaped, so a message about them can be printed and logged."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _messages(value: Any) -> list[dict[str, str]] | None:
    """`value` as chat messages, or None if it is not a list of {role, content} dicts."""
    if not isinstance(value, list) or not value:
        return None
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _answer(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def _problem(row: dict[str, Any], cfg: TaskConfig, fields: dict[str, str], where: str, line: str) -> Problem:
    key = fields["prompt"]
    if key not in row:
        raise ValueError(
            f"{where}: missing prompt field '{key}' (task.fields.prompt); "
            f"the line has keys {sorted(row)}: {_snippet(line)}"
        )
    raw = row[key]
    prompt: str | list[dict[str, str]]
    if isinstance(raw, str):
        question = raw
        prompt = render_prompt(raw, cfg)
        content: str | list[dict[str, str]] = raw
    elif (msgs := _messages(raw)) is not None:
        user = [m["content"] for m in msgs if m["role"] == "user"]
        question = user[-1] if user else msgs[-1]["content"]
        prompt = msgs
        if cfg.system_prompt and not any(m["role"] == "system" for m in msgs):
            prompt = [{"role": "system", "content": cfg.system_prompt}, *msgs]
        content = msgs
    else:
        raise ValueError(
            f"{where}: prompt field '{key}' must be a string or a list of "
            f"{{role, content}} messages, got {type(raw).__name__}: {_snippet(line)}"
        )
    pid = row.get(fields["id"])
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, str | int)):
        raise ValueError(
            f"{where}: id field '{fields['id']}' (task.fields.id) must be a string or an integer, "
            f"got {type(pid).__name__}: {_snippet(line)}"
        )
    if isinstance(raw, str) and not raw.strip():
        raise ValueError(f"{where}: prompt field '{key}' is empty: {_snippet(line)}")
    # JSON may escape a lone surrogate no tokenizer encodes; any column may become text (hints, teachers)
    if (name := bad_unicode(row)) is not None:
        text = json.dumps({name: row[name]}, ensure_ascii=False)
        try:
            text.encode("utf-8")
            shown = ""
        except UnicodeEncodeError as err:
            shown = text[err.start:err.end].encode("utf-8", "backslashreplace").decode() + ", "
        raise ValueError(f"{where}: field '{printable(name)}' holds a character that is not valid Unicode text "
                         f"({shown}a lone surrogate): {_snippet(line)}")
    answer = _answer(row.get(fields["answer"]))
    if cfg.answer_after is not None and answer is not None:
        if cfg.answer_after not in answer:
            raise ValueError(f"{where}: answer field '{fields['answer']}' has no '{cfg.answer_after}' "
                             f"(task.answer_after): {_snippet(line)}")
        answer = answer.rsplit(cfg.answer_after, 1)[1].strip()
    columns = {k: v for k, v in row.items() if k not in (fields["id"], fields["prompt"], fields["answer"])}
    columns["question"] = question
    return Problem(
        id=problem_id(content) if pid is None else str(pid),
        prompt=prompt,
        answer=answer,
        columns=columns,
    )


class BadLines:
    """The bad lines of one file that were skipped: how many, and the first one's message."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def add(self, message: str) -> None:
        self.count += 1
        if self.first is None:
            self.first = message

    def settle(self, where: str, total: int, good: int, cfg: TaskConfig, into: BadLines | None,
               unit: str = "line") -> None:
        """After reading `total` lines (or rows), `good` of them problems: an error when all, or more
        than `task.max_bad_fraction`, were bad; otherwise a warning, and the count added to `into`."""
        if not self.count:
            return
        if not good:
            raise ValueError(f"{where}: all {total} {unit}s are bad; the first: {self.first}")
        if self.count > cfg.max_bad_fraction * total:
            raise ValueError(f"{where}: {self.count} of {total} {unit}s are bad, more than task.max_bad_fraction "
                             f"({cfg.max_bad_fraction:g}) allows; the first: {self.first}")
        log.warning("%s: skipped %d bad %s%s of %d; the first: %s", where, self.count, unit,
                    "s" if self.count > 1 else "", total, self.first)
        if into is not None:
            into.count += self.count
            into.first = into.first or self.first


def _parse_line(raw: bytes, n: int, path: str | Path, cfg: TaskConfig, fields: dict[str, str],
                seen: set[str] | None = None) -> Problem | None:
    """The problem on line `n` (None for a blank line); ValueError naming the line if it is bad."""
    where = f"{path}, line {n}"
    if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        shown = _snippet(raw.decode("utf-8", errors="replace"))
        raise ValueError(f"{where}: not valid UTF-8 (byte {err.start + 1} of the line): {shown}") from None
    if not line.strip():
        return None
    if (deep := scan_depth([raw])) is not None:
        raise ValueError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep (column {deep[1]}): "
                         f"{_snippet(line)}")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        why = f"{err.msg}, column {err.colno}"
        raise ValueError(f"{where}: not valid JSON ({why}): {_snippet(line)}") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply): {_snippet(line)}") from None
    if not isinstance(row, dict):
        kind = type(row).__name__
        raise ValueError(f"{where}: expected a JSON object, got {kind}: {_snippet(line)}")
    if seen is not None:
        seen.update(row)
    return _problem(row, cfg, fields, where, line)


def read_jsonl(path: str | Path, cfg: TaskConfig, bad: BadLines | None = None) -> list[Problem]:
    """Every problem of one file, in file order (duplicates kept); blank lines are skipped.

    A bad line raises ValueError naming it, unless `cfg.skip_bad_lines`: then it is skipped and
    counted in `bad` (at most `cfg.max_bad_fraction` of the non-blank lines may be bad).
    """
    fields = field_map(cfg)
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"task file not found: {path}")
    check_file_size(p, cfg.max_file_mb, path)
    max_row = int(cfg.max_row_mb * (1 << 20))
    skipped = BadLines()
    problems = []
    lines = 0
    seen: set[str] = set()
    with p.open("rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(max_row + 1), b""), start=1):
            try:
                if len(raw) > max_row:  # read no more of it than the limit: skip the rest of the line
                    while (rest := f.readline(_SKIP)) and not rest.endswith(b"\n"):
                        pass
                    head = _snippet(raw[:80].decode("utf-8", "replace"))
                    raise ValueError(f"{path}, line {n}: the line is over {mib(max_row)}, more than "
                                     f"task.max_row_mb ({cfg.max_row_mb:g}) allows: {head}")
                problem = _parse_line(raw, n, path, cfg, fields, seen)
            except ValueError as err:
                if not cfg.skip_bad_lines:
                    raise ValueError(f"{err} (set task.skip_bad_lines: true to skip bad lines)") from None
                lines += 1
                skipped.add(str(err))
                continue
            if problem is not None:
                lines += 1
                problems.append(problem)
    skipped.settle(str(path), lines, len(problems), cfg, bad)
    if not problems:
        raise ValueError(f"{path}: the file has no problems (it is empty)")
    for role, key in cfg.fields.items():  # a mapping the user wrote must match a key of the file
        if key != DEFAULT_FIELDS.get(role) and key not in seen:
            close = difflib.get_close_matches(key, sorted(seen), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"task.fields.{role}: no line of {path} has the key '{key}'{hint} "
                             f"(its keys: {', '.join(sorted(seen)[:20])})")
    return problems


def load_jsonl(cfg: TaskConfig, data_seed: int) -> TaskSource:
    """Training and eval problems from `cfg.path` (and `cfg.eval_path`)."""
    if not cfg.path:
        raise ValueError("task.path is required for source 'jsonl'")
    bad = BadLines()
    problems = read_jsonl(cfg.path, cfg, bad)
    unique = dedupe(problems)
    if len(unique) < len(problems):
        log.info("%s: %d lines repeat an earlier id and were merged", cfg.path, len(problems) - len(unique))
    if cfg.eval_path:
        held = dedupe(read_jsonl(cfg.eval_path, cfg, bad))[: cfg.eval_size]
        train = remove_held(unique, held)
        if not train:
            raise ValueError(f"{cfg.path}: every problem is also in the eval file {cfg.eval_path}")
        if len(train) < len(unique):
            log.info("%s: %d problems also in %s were removed from training",
                     cfg.path, len(unique) - len(train), cfg.eval_path)
    else:
        if cfg.eval_size >= len(unique):
            raise ValueError(
                f"{cfg.path}: task.eval_size is {cfg.eval_size} but the file has only {len(unique)} distinct "
                "problems; at least one must be left for training (lower task.eval_size or set task.eval_path)"
            )
        train, held = split_held_out(unique, cfg.eval_size, data_seed, what=cfg.path)
    return TaskSource(train=train, eval=held, name=Path(cfg.path).stem, skipped=bad.count, first_bad=bad.first)

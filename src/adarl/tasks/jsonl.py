"""Problems from a JSON-lines file, one object per line, with a held-out eval split.

``task.fields`` maps ``id``/``prompt``/``answer`` to the file's keys (keys left out keep
their defaults). The prompt is a string (rendered with the system prompt and template) or
a list of chat messages (used as given, after the system prompt if the list has none).
A line without the id key gets a content hash of its prompt; without the answer key, no
answer. Every other key becomes a column. Problems are unique by id: a repeated id keeps
its first line.

Eval comes from ``task.eval_path`` when set (at most ``eval_size`` problems), otherwise
the last ``eval_size`` distinct ids of a seeded shuffle are held out. Either way, every
problem whose id is in eval is removed from training.
"""

from __future__ import annotations

import difflib
import json
import logging
import random
from pathlib import Path
from typing import Any

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, dedupe, problem_id, render_prompt
from adarl.types import Problem

log = logging.getLogger(__name__)

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
    return repr(line if len(line) <= width else line[:width] + "...")


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
    columns = {k: v for k, v in row.items() if k not in (fields["id"], fields["prompt"], fields["answer"])}
    columns["question"] = question
    return Problem(
        id=problem_id(content) if pid is None else str(pid),
        prompt=prompt,
        answer=_answer(row.get(fields["answer"])),
        columns=columns,
    )


def read_jsonl(path: str | Path, cfg: TaskConfig) -> list[Problem]:
    """Every problem of one file, in file order (duplicates kept); blank lines are skipped."""
    fields = field_map(cfg)
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"task file not found: {path}")
    problems = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                why = f"{err.msg}, column {err.colno}"
                raise ValueError(f"{where}: not valid JSON ({why}): {_snippet(line)}") from None
            if not isinstance(row, dict):
                kind = type(row).__name__
                raise ValueError(f"{where}: expected a JSON object, got {kind}: {_snippet(line)}")
            problems.append(_problem(row, cfg, fields, where, line))
    if not problems:
        raise ValueError(f"{path}: the file has no problems (it is empty)")
    return problems


def split_held_out(
    problems: list[Problem], eval_size: int, seed: int, path: str
) -> tuple[list[Problem], list[Problem]]:
    """Hold out the last `eval_size` distinct ids of a seeded shuffle; the rest is training."""
    unique = dedupe(problems)
    if eval_size >= len(unique):
        raise ValueError(
            f"{path}: task.eval_size is {eval_size} but the file has only {len(unique)} distinct "
            "problems; at least one must be left for training (lower task.eval_size or set task.eval_path)"
        )
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    held = [unique[i] for i in order[len(order) - eval_size:]] if eval_size else []
    held_ids = {p.id for p in held}
    return [p for p in unique if p.id not in held_ids], held


def load_jsonl(cfg: TaskConfig, seed: int) -> TaskSource:
    """Training and eval problems from `cfg.path` (and `cfg.eval_path`)."""
    if not cfg.path:
        raise ValueError("task.path is required for source 'jsonl'")
    problems = read_jsonl(cfg.path, cfg)
    unique = dedupe(problems)
    if len(unique) < len(problems):
        log.info("%s: %d lines repeat an earlier id and were merged", cfg.path, len(problems) - len(unique))
    if cfg.eval_path:
        held = dedupe(read_jsonl(cfg.eval_path, cfg))[: cfg.eval_size]
        held_ids = {p.id for p in held}
        train = [p for p in unique if p.id not in held_ids]
        if not train:
            raise ValueError(f"{cfg.path}: every problem is also in the eval file {cfg.eval_path}")
        if len(train) < len(unique):
            log.info("%s: %d problems also in %s were removed from training",
                     cfg.path, len(unique) - len(train), cfg.eval_path)
    else:
        train, held = split_held_out(unique, cfg.eval_size, seed, cfg.path)
    return TaskSource(train=train, eval=held, name=Path(cfg.path).stem)

"""What every task source shares: the `TaskSource` container, stable ids, prompt rendering."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from adarl.config import TaskConfig
from adarl.types import Problem


@dataclass
class TaskSource:
    """Training problems and a held-out eval split; no eval id ever appears in `train`."""

    train: list[Problem]
    eval: list[Problem]
    name: str
    skipped: int = 0  # bad data lines skipped (task.skip_bad_lines)
    first_bad: str | None = None  # the first skipped line's error message

    def __repr__(self) -> str:
        return f"TaskSource(name={self.name!r}, train={len(self.train)}, eval={len(self.eval)})"


def problem_id(text: str | list[dict[str, str]]) -> str:
    """A stable content hash (16 hex chars of sha1), the same on every run and machine."""
    if not isinstance(text, str):
        text = json.dumps(text, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def render_prompt(question: str, cfg: TaskConfig) -> list[dict[str, str]]:
    """Chat messages for one question: optional system message, then the templated user turn.

    Only the literal ``{prompt}`` in `cfg.prompt_template` is substituted, so other braces in
    the template (or in the question) are left alone.
    """
    messages = []
    if cfg.system_prompt:
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": cfg.prompt_template.replace("{prompt}", question)})
    return messages


def is_scalar(value: Any) -> bool:
    """True for the JSON-serialisable scalars kept as columns."""
    return value is None or isinstance(value, (str, int, float, bool))


def dedupe(problems: list[Problem]) -> list[Problem]:
    """Keep the first problem of each id, in order."""
    seen: set[str] = set()
    out = []
    for p in problems:
        if p.id not in seen:
            seen.add(p.id)
            out.append(p)
    return out


def build_task(cfg: TaskConfig, seed: int) -> TaskSource:
    """Build the task `cfg` describes; `cfg.seed` wins over `seed` (the recipe's) when set."""
    seed = cfg.seed if cfg.seed is not None else seed
    if cfg.source == "reasoning_gym":
        from adarl.tasks.reasoning_gym import load_reasoning_gym

        return load_reasoning_gym(cfg, seed)
    if cfg.source == "jsonl":
        from adarl.tasks.jsonl import load_jsonl

        return load_jsonl(cfg, seed)
    if cfg.source == "humaneval":
        from adarl.tasks.humaneval import load_humaneval

        return load_humaneval(cfg, seed)
    raise ValueError(f"unknown task source '{cfg.source}' (choices: reasoning_gym, jsonl, humaneval)")

"""What every task source shares: the `TaskSource` container, stable ids, prompt rendering, and
the held-out split rule (`split_held_out`)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

from adarl.config import TaskConfig
from adarl.types import Problem

log = logging.getLogger(__name__)


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


def prompt_key(problem: Problem) -> str:
    """The problem's prompt as one string, to compare prompts across splits."""
    return json.dumps(problem.prompt, sort_keys=True, ensure_ascii=False)


def remove_held(train: list[Problem], held: list[Problem]) -> list[Problem]:
    """`train` without any problem whose id or prompt is also in `held`."""
    held_ids = {p.id for p in held}
    held_prompts = {prompt_key(p) for p in held}
    return [p for p in train if p.id not in held_ids and prompt_key(p) not in held_prompts]


def split_held_out(
    pool: list[Problem], eval_size: int, seed: int | str, *, train_size: int | None = None, what: str = "task"
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): the one held-out rule of every task source.

    The de-duplicated `pool` is shuffled by `random.Random(seed)`; its last `eval_size` problems
    are held out, in shuffled order (so any prefix of eval is a random sample too), and the rest
    is training, in pool order, at most `train_size` of it. A random split of one pool gives
    eval the training distribution; "the generator's items that are not in training" would not,
    since when training covers most of a small problem space those are its rarest leftovers.

    Eval is filled first. When `train_size` is given and the pool has fewer than
    `train_size + eval_size` distinct problems, a warning says how many were found and asked.
    No problem whose id or prompt is held out stays in training.
    """
    unique = dedupe(pool)
    n_eval = min(eval_size, len(unique))
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    cut = len(order) - n_eval
    held = [unique[i] for i in order[cut:]]
    train = remove_held([unique[i] for i in sorted(order[:cut])], held)
    if train_size is not None:
        train = train[:train_size]
        if len(unique) < train_size + eval_size:
            log.warning("%s: only %d distinct problems, of the %d asked (task.size %d + task.eval_size %d); "
                        "eval holds %d and training %d. Lower task.size or task.eval_size, or widen the task",
                        what, len(unique), train_size + eval_size, train_size, eval_size, len(held), len(train))
    return train, held

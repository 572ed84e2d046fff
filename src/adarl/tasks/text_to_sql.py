"""Text-to-SQL over the shipped corpus (ReEx-SQL, TableGPT-R1): `task.source: text_to_sql`.

The corpus (src/adarl/data/text_to_sql/, made by tasks/text_to_sql_corpus.py) holds four SQLite
databases (shop, school, library, flights) and 394 questions with gold queries. A prompt shows the
database's CREATE TABLE statements and the question; the model may explore the database with the
`query` tool (`rollout.agent.environment: text_to_sql`, read-only) and answers with one query in a
```sql block, which `rewards: [{type: sql_execution}]` runs and compares with the gold query's result
(rewards/sql.py). A problem's columns: `db`, `sql` (gold), `ordered` (the question fixes the order of
the rows), `question`, `template`; its `answer` is the gold query in a ```sql block (what an SFT
demonstration ends with).

Held-out split (`task.params.held_out`):
    instances (default)   the corpus's own split: per template, every fourth instance (other
                          values of the same question shapes, on the same schemas): 300 train, 94 held out
    shop | school | library | flights
                          every question on that database is held out, the other three train
                          (generalising to an unseen schema)
Training problems are shuffled by `task.data_seed` and cut to `task.size`, held-out ones to
`task.eval_size`.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import random
from typing import Any

from adarl.rewards.sql import DATABASES, create_statements
from adarl.tasks.base import TaskSource, problem_id, render_prompt
from adarl.types import Problem

log = logging.getLogger(__name__)
INSTRUCTION = "Answer with one SQLite query in a ```sql block."


def questions() -> list[dict[str, Any]]:
    """The corpus's questions (questions.jsonl)."""
    text = (importlib.resources.files("adarl") / "data" / "text_to_sql" / "questions.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def problem(q: dict[str, Any], cfg: Any, schemas: dict[str, str]) -> Problem:
    text = f"SQLite database {q['db']}:\n{schemas[q['db']]}\n\nQuestion: {q['question']}\n{INSTRUCTION}"
    return Problem(id=problem_id(text), prompt=render_prompt(text, cfg), answer=f"```sql\n{q['sql']}\n```",
                   columns={"db": q["db"], "sql": q["sql"], "ordered": bool(q["ordered"]),
                            "question": q["question"], "template": q["template"]})


def load_text_to_sql(cfg: Any) -> TaskSource:
    """`task.source: text_to_sql` (see the module docstring)."""
    held_out = (cfg.params or {}).get("held_out", "instances")
    if held_out not in ("instances", *DATABASES):
        raise ValueError(f"task.params.held_out {held_out!r}: expected 'instances' or a database "
                         f"({', '.join(DATABASES)})")
    schemas = {name: create_statements(name) for name in DATABASES}
    train, held = [], []
    for q in questions():
        out = held if (q["split"] == "held_out" if held_out == "instances" else q["db"] == held_out) else train
        out.append(problem(q, cfg, schemas))
    rng = random.Random(cfg.data_seed)
    rng.shuffle(train)
    rng.shuffle(held)
    if len(train) < cfg.size or len(held) < cfg.eval_size:
        log.warning("text_to_sql: %d training and %d held-out questions (task.size %d, task.eval_size %d asked)",
                    len(train), len(held), cfg.size, cfg.eval_size)
    return TaskSource(train[:cfg.size], held[:cfg.eval_size], "text_to_sql")

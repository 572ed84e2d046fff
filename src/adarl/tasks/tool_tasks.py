"""Procedural tasks that need tools (issue 15): answers the model can only get by calling them.

    task: {source: sql}          questions over a small generated SQLite table; tool: `query(sql)`
    task: {source: retrieval}    questions whose answers exist only in a generated corpus; tool: `search(query)`

Both are seeded by `task.data_seed` (the held-out split too) and give `task.size + task.eval_size`
distinct problems. The environments are rollout/tools.py's `sql` and `search`: the recipe names
them in `rollout.agent.environment`. Each problem's row carries what its environment needs (the
table's rows as JSON; the corpus seed) and a gold solution for the environment's `demonstration`
(SFT cold start): the SQL that answers it, or the search that finds it.
"""

from __future__ import annotations

import json
import random
import sqlite3
from typing import Any

from adarl.tasks.base import problem_id, render_prompt
from adarl.tasks.reasoning_gym import derive_seed
from adarl.types import Problem

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Milo", "Nia",
         "Omar", "Pia", "Quin", "Rui", "Sana", "Teo", "Uma", "Vik", "Wen", "Xia", "Yara", "Zed"]
TEAMS = ["red", "blue", "green", "gold"]
SCHEMA = "CREATE TABLE staff (name TEXT, team TEXT, salary INTEGER, age INTEGER)"


def staff_table(rng: random.Random) -> list[tuple[str, str, int, int]]:
    """10-16 people with distinct names, a team, a salary (multiple of 100) and an age."""
    names = rng.sample(NAMES, rng.randint(10, 16))
    return [(n, rng.choice(TEAMS), 100 * rng.randint(20, 90), rng.randint(21, 64)) for n in names]


def run_sql(rows: list[Any], sql: str) -> list[tuple]:
    db = sqlite3.connect(":memory:")
    db.execute(SCHEMA)
    db.executemany("INSERT INTO staff VALUES (?, ?, ?, ?)", rows)
    return db.execute(sql).fetchall()


def sql_problem(rng: random.Random, cfg: Any) -> Problem | None:
    rows = staff_table(rng)
    team = rng.choice(TEAMS)
    kind = rng.randrange(3)
    if kind == 0:
        question, sql = f"What is the total salary of the {team} team?", \
            f"SELECT SUM(salary) FROM staff WHERE team = '{team}'"
    elif kind == 1:
        age = rng.randint(25, 55)
        question, sql = f"How many people in the {team} team are older than {age}?", \
            f"SELECT COUNT(*) FROM staff WHERE team = '{team}' AND age > {age}"
    else:
        question, sql = f"Who is the oldest person in the {team} team?", \
            f"SELECT name FROM staff WHERE team = '{team}' ORDER BY age DESC LIMIT 2"
    result = run_sql(rows, sql)
    if kind == 2:  # a unique oldest person only
        ages = {r[3] for r in rows if r[1] == team}
        if not result or sum(r[3] == max(ages) for r in rows if r[1] == team) != 1:
            return None
        result, sql = result[:1], sql.replace("LIMIT 2", "LIMIT 1")
    answer = result[0][0]
    if answer is None:  # an empty team: SUM is NULL
        return None
    company = f"{_word(rng)} {rng.choice(['Ltd', 'Inc', 'Works', 'Labs'])}"  # distinct prompts for distinct tables
    text = (f"The SQLite table {SCHEMA[len('CREATE TABLE '):]} lists the staff of {company}. {question} "
            "Query the table to find out, then reply with only the answer.")
    return Problem(id=_id(text, rows), prompt=render_prompt(text, cfg), answer=str(answer),
                   columns={"question": question, "table": json.dumps(rows), "sql": sql})


# ---------------------------------------------------------------- retrieval

CREATURES = ["fox", "owl", "otter", "lynx", "heron", "badger", "marten", "crane", "stoat", "ibis"]
SYLLABLES = ["ka", "lo", "mi", "ru", "ze", "ta", "po", "ni", "sa", "vu", "de", "ro"]


def _word(rng: random.Random, parts: int = 3) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def corpus(seed: int, size: int = 400) -> list[dict[str, str]]:
    """`size` facts about invented creatures: who they are, where they live, what they eat. The same
    seed gives the same corpus (the environment rebuilds it from the seed in the problem's row)."""
    rng = random.Random(seed)
    docs, seen = [], set()
    while len(docs) < size:
        name = _word(rng)
        if name in seen:
            continue
        seen.add(name)
        creature, place, food = rng.choice(CREATURES), _word(rng, 2) + " Valley", _word(rng, 2).lower() + " berries"
        docs.append({"name": name, "creature": creature, "place": place, "food": food,
                     "text": f"{name} is {'an' if creature[0] in 'aeiou' else 'a'} {creature}. {name} lives in "
                             f"{place} and eats {food}."})
    return docs


def sql(cfg: Any) -> list[Problem]:
    """`task.source: sql` (see the module docstring)."""
    rng = random.Random(derive_seed(cfg.data_seed, "sql"))
    out: list[Problem] = []
    wanted, tries = cfg.size + cfg.eval_size, 0
    while len(out) < wanted and tries < 20 * wanted:
        tries += 1
        p = sql_problem(rng, cfg)
        if p is not None:
            out.append(p)
    return out


def retrieval(cfg: Any) -> list[Problem]:
    """`task.source: retrieval` (see the module docstring): one corpus, a question per fact."""
    seed = derive_seed(cfg.data_seed, "corpus")
    docs = corpus(seed, max(400, cfg.size + cfg.eval_size))
    rng = random.Random(derive_seed(cfg.data_seed, "questions"))
    out = []
    for d in rng.sample(docs, min(len(docs), cfg.size + cfg.eval_size)):
        if rng.random() < 0.5:
            question, answer = f"Where does {d['name']} live?", d["place"]
        else:
            question, answer = f"What does {d['name']} eat?", d["food"]
        text = f"{question} Search the encyclopedia to find out, then reply with only the answer."
        out.append(Problem(id=_id(text, seed), prompt=render_prompt(text, cfg), answer=answer,
                           columns={"question": question, "corpus_seed": seed, "corpus_size": len(docs),
                                    "query": d["name"]}))
    return out


def _id(text: str, salt: Any) -> str:
    return problem_id(f"{text}\n{json.dumps(salt)}")

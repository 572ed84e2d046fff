"""Tasks that need tools (SQL over a generated table, retrieval from a generated corpus) and their
environments: answers checked against the data directly, the database read-only and bounded."""

from __future__ import annotations

import json
import re

import pytest

from adarl.config import TaskConfig
from adarl.rollout.agent import AgentGenerator
from adarl.rollout.tools import Search, SqlDatabase
from adarl.tasks import build_task
from adarl.tasks.tool_tasks import corpus, retrieval, sql
from conftest import make_tiny_tokenizer


def expected_sql_answer(question: str, rows: list) -> str:
    """The answer worked out from the rows in Python, not by SQL."""
    team = re.search(r"the (\w+) team", question).group(1)
    members = [r for r in rows if r[1] == team]
    if question.startswith("What is the total salary"):
        return str(sum(r[2] for r in members))
    if question.startswith("How many"):
        age = int(re.search(r"older than (\d+)", question).group(1))
        return str(sum(r[3] > age for r in members))
    return max(members, key=lambda r: r[3])[0]


def test_sql_problems_are_answered_by_their_table():
    problems = sql(TaskConfig(source="sql", size=40, eval_size=10))
    assert len(problems) == 50 and len({p.id for p in problems}) == 50
    for p in problems:
        assert p.answer == expected_sql_answer(p.columns["question"], json.loads(p.columns["table"]))
    again = sql(TaskConfig(source="sql", size=40, eval_size=10))
    assert [p.id for p in again] == [p.id for p in problems]  # seeded by task.data_seed
    task = build_task(TaskConfig(source="sql", size=40, eval_size=10))
    assert len(task.train) == 40 and len(task.eval) == 10 and not {p.id for p in task.train} & {p.id for p in task.eval}


def test_the_database_is_read_only_and_bounded():
    p = sql(TaskConfig(source="sql", size=5, eval_size=1))[0]
    db = SqlDatabase()
    db.reset(**p.columns)
    assert db.query(p.columns["sql"]).splitlines()[0] == p.answer
    for write in ("DROP TABLE staff", "DELETE FROM staff", "INSERT INTO staff VALUES ('x', 'red', 1, 1)",
                  "ATTACH DATABASE '/tmp/adarl-x.db' AS x", "PRAGMA writable_schema = 1",
                  "CREATE TEMP TABLE t (a)"):
        assert db.query(write).startswith("error"), write
    assert db.query("SELECT COUNT(*) FROM staff").strip().isdigit()  # still intact
    # 16^6 rows to count: the step budget stops it with an error instead of hanging the loop
    huge = "SELECT COUNT(*) FROM staff a, staff b, staff c, staff d, staff e, staff f"
    assert db.query(huge).startswith("error: interrupted")
    assert db.query("SELEC nonsense").startswith("error: near")  # execution feedback


def test_retrieval_answers_are_in_the_corpus_and_found_by_search():
    problems = retrieval(TaskConfig(source="retrieval", size=30, eval_size=10))
    env = Search()
    for p in problems[:10]:
        env.reset(**p.columns)
        doc = next(d for d in corpus(p.columns["corpus_seed"], p.columns["corpus_size"])
                   if d["name"] == p.columns["query"])
        assert p.answer in doc["text"]
        assert env.search(p.columns["query"]).splitlines()[0] == doc["text"]  # BM25 ranks the entity's page first
    assert env.search("   ") == "error: empty query"


@pytest.mark.parametrize("source,environment", [("sql", SqlDatabase), ("retrieval", Search)])
def test_demonstrations_call_the_tool_and_see_the_answer(source, environment):
    from adarl.config import RolloutConfig

    class Gen:
        capabilities = frozenset({"stop_strings"})
        tokenizer, cfg, policy_version = make_tiny_tokenizer(), RolloutConfig(), 0

        def add_stop(self, stop):
            self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    p = (sql if source == "sql" else retrieval)(TaskConfig(source=source, size=3, eval_size=1))[0]
    ag = AgentGenerator(Gen(), environment, {p.id: p})
    demo = ag.demonstration(p)
    tool = next(s for s in demo.spans if s.role == "tool")
    assert p.answer in Gen.tokenizer.decode(tool.ids)  # the tool's real output holds the answer


def test_a_sql_agent_trains_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer", "match": "exact"}],
                       rollout={"temperature": 1.0, "max_new_tokens": 8,
                                "agent": {"environment": "sql", "max_turns": 2, "max_context_tokens": 256}},
                       allocate={"name": "fixed", "n": 2}, log={"tensorboard": False, "progress": False})
    data["task"] = {"source": "sql", "size": 20, "eval_size": 4}
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    assert "query" in trainer.tokenizer.decode(trainer.prompt_ids(trainer.task.train[0]))  # the tool is described
    row = trainer.train_step()
    assert row["step_rollouts"] == 4

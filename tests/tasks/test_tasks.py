"""Task sources: stable ids, determinism, held-out splits, field mapping, error messages."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from adarl.config import TaskConfig
from adarl.tasks import TaskSource, build_task, problem_id, render_prompt

ADD2 = {  # "Calculate a + b." with operands in 0..100
    "min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
    "operators": ["+"], "allow_parentheses": False, "allow_negation": False,
}
ADD1 = {**ADD2, "min_digits": 1, "max_digits": 1}  # operands 0..10: only 121 distinct problems


def rg(**kw: object) -> TaskConfig:
    return TaskConfig(**{"name": "basic_arithmetic", "params": ADD2, "size": 200, "eval_size": 30, **kw})


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def ids(problems: list) -> list[str]:
    return [p.id for p in problems]


# ---------------------------------------------------------------- shared helpers


def test_problem_id_is_a_stable_content_hash() -> None:
    text = "Calculate 5 + 33."
    assert problem_id(text) == hashlib.sha1(text.encode()).hexdigest()[:16] == "4a2c65ccc7f59f38"
    assert problem_id(text) != problem_id("Calculate 5 + 34.")
    msgs = [{"role": "user", "content": text}]
    assert problem_id(msgs) == problem_id([{"content": text, "role": "user"}])


def test_render_prompt_with_system_prompt_and_template() -> None:
    cfg = TaskConfig(name="x", system_prompt="Be brief.", prompt_template="Q: {prompt}\nPut it in {braces}.")
    assert render_prompt("What is {x}?", cfg) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: What is {x}?\nPut it in {braces}."},
    ]
    assert render_prompt("hi", TaskConfig(name="x")) == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- reasoning_gym


def test_reasoning_gym_is_deterministic_and_seeded() -> None:
    a, b = build_task(rg(data_seed=3)), build_task(rg(data_seed=3))
    assert isinstance(a, TaskSource) and a.name == "basic_arithmetic"
    assert ids(a.train) == ids(b.train) and ids(a.eval) == ids(b.eval)
    assert [p.prompt for p in a.train] == [p.prompt for p in b.train]
    c = build_task(rg(data_seed=4))
    assert len(set(ids(a.train)) & set(ids(c.train))) < len(a.train) // 2  # seed 4 is not seed 3 shifted
    assert ids(build_task(rg(data_seed=3), seed=99).train) == ids(a.train)  # the training seed plays no part


def test_reasoning_gym_problems_and_held_out_split() -> None:
    task = build_task(rg(system_prompt="S", prompt_template="{prompt} Answer:"), seed=0)
    assert len(task.eval) == 30 and len(set(ids(task.eval))) == 30
    assert len(set(ids(task.train))) == len(task.train)
    assert not set(ids(task.train)) & set(ids(task.eval))
    p = task.train[0]
    q = p.columns["question"]
    assert q.startswith("Calculate ") and " + " in q
    a, b = (int(x) for x in p.columns["expression"].split(" + "))
    assert p.answer == str(a + b)
    assert p.id == problem_id(q)
    assert p.prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": f"{q} Answer:"}]
    assert all(not isinstance(v, (dict, list, tuple)) for v in p.columns.values())
    json.dumps(p.columns)


def test_reasoning_gym_dedupes_and_stops_at_the_problem_space() -> None:
    # 300 distinct asked of 121: 4·300 = 1200 draws miss one of 121 equally likely problems with
    # probability ≤ 121·(1 − 1/121)^1200 ≈ 121·e^(−9.96) ≈ 0.006
    task = build_task(rg(params=ADD1, size=300, eval_size=0), seed=0)
    assert len(task.train) == len(set(ids(task.train))) == 121 and task.eval == []
    with pytest.raises(ValueError, match=r"'basic_arithmetic' gave only 121 distinct problems in 1000 draws"):
        build_task(rg(params=ADD1, size=10, eval_size=200), seed=0)


def test_reasoning_gym_unknown_generator_suggests_close_names() -> None:
    with pytest.raises(ValueError, match="did you mean 'basic_arithmetic'"):
        build_task(TaskConfig(name="basic_arithmetc"), seed=0)


def test_reasoning_gym_bad_params_name_generator_and_param() -> None:
    with pytest.raises(ValueError, match=r"'max_digit'.*'basic_arithmetic'.*did you mean 'max_digits'"):
        build_task(rg(params={"max_digit": 2}), seed=0)
    with pytest.raises(ValueError, match=r"basic_arithmetic.*max_digits must be >= min_digits"):
        build_task(rg(params={"min_digits": 3, "max_digits": 2}), seed=0)
    with pytest.raises(ValueError, match=r"task.params.seed.*task.seed"):
        build_task(rg(params={"seed": 1}), seed=0)


# ---------------------------------------------------------------- jsonl


def test_jsonl_field_mapping_and_columns(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "math.jsonl", [
        {"question": "1+1?", "solution": 2, "level": "easy"},
        {"question": "2+2?", "solution": "4", "level": "easy", "key": "q2"},
        {"question": [{"role": "user", "content": "3+3?"}], "solution": 6},
    ])
    cfg = TaskConfig(source="jsonl", path=str(f), eval_size=0, system_prompt="Sys",
                     fields={"prompt": "question", "answer": "solution", "id": "key"})
    task = build_task(cfg, seed=0)
    assert task.name == "math" and task.eval == []
    p0, p1, p2 = task.train
    assert p0.id == problem_id("1+1?") and p1.id == "q2"
    assert (p0.answer, p1.answer, p2.answer) == ("2", "4", "6")
    assert p0.columns == {"level": "easy", "question": "1+1?"}
    assert p0.prompt == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "1+1?"}]
    assert p2.prompt == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "3+3?"}]
    assert p2.columns["question"] == "3+3?"


def test_jsonl_held_out_split_is_disjoint_with_duplicate_lines(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i % 25}", "answer": str(i % 25)} for i in range(60)]  # every id repeats
    rows += [{"id": "fixed", "prompt": "a"}, {"id": "fixed", "prompt": "b"}]
    cfg = TaskConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), eval_size=10, data_seed=1)
    task = build_task(cfg)
    train_ids, eval_ids = ids(task.train), ids(task.eval)
    assert len(eval_ids) == len(set(eval_ids)) == 10
    assert len(train_ids) == len(set(train_ids)) == 26 - 10
    assert not set(train_ids) & set(eval_ids)
    again = build_task(cfg, seed=7)  # another training seed: the same split
    assert ids(again.train) == train_ids and ids(again.eval) == eval_ids
    assert set(ids(build_task(cfg.model_copy(update={"data_seed": 2})).eval)) != set(eval_ids)


def test_jsonl_eval_file_removes_its_ids_from_training(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"q{i}"} for i in range(7, 13)])
    cfg = TaskConfig(source="jsonl", path=str(train), eval_path=str(held), eval_size=4)
    task = build_task(cfg, seed=0)
    assert [p.columns["question"] for p in task.eval] == ["q7", "q8", "q9", "q10"]
    assert [p.columns["question"] for p in task.train] == [f"q{i}" for i in range(7)]


def test_jsonl_eval_file_removes_its_prompts_from_training_whatever_the_ids(tmp_path: Path) -> None:
    # the same question under another id is still the same question: it must not be trained on
    train = write_jsonl(tmp_path / "train.jsonl", [{"id": f"t{i}", "prompt": f"q{i}"} for i in range(6)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"id": "e1", "prompt": "q1"}, {"id": "e4", "prompt": "q4"}])
    task = build_task(TaskConfig(source="jsonl", path=str(train), eval_path=str(held), eval_size=2), seed=0)
    assert ids(task.eval) == ["e1", "e4"] and ids(task.train) == ["t0", "t2", "t3", "t5"]


def test_jsonl_error_messages(tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "", '{"prompt": "oops",'])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not valid JSON.*'\{\"prompt\": \"oops\",'"):
        build_task(TaskConfig(source="jsonl", path=str(bad), eval_size=0), seed=0)

    missing = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "ok"}, {"text": "no prompt here"}])
    msg = r"missing\.jsonl, line 2: missing prompt field 'prompt'.*no prompt here"
    with pytest.raises(ValueError, match=msg):
        build_task(TaskConfig(source="jsonl", path=str(missing), eval_size=0), seed=0)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*empty"):
        build_task(TaskConfig(source="jsonl", path=str(empty)), seed=0)

    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}])
    with pytest.raises(ValueError, match=r"eval_size is 2 but the file has only 2 distinct problems"):
        build_task(TaskConfig(source="jsonl", path=str(small), eval_size=2), seed=0)

    with pytest.raises(ValueError, match=r"task.fields.anwser.*did you mean 'answer'"):
        build_task(TaskConfig(source="jsonl", path=str(small), fields={"anwser": "x"}), seed=0)

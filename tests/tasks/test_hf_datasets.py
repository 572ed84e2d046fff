"""task.source: hf_datasets reads local parquet/json/csv/arrow files and save_to_disk folders.

The rows become problems by the JSONL source's rules (same fields, same held-out split, same bad-row
handling); every dataset here is written by the test and its problems are checked by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adarl.config import TaskConfig
from adarl.tasks import build_task
from adarl.tasks.hf_datasets import load_hf_datasets

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # never the user's cache
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # the source must turn it on itself
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty hub cache: a Hub id is not cached
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# six plain-text problems: q1..q6 ask "What is k+k?" (k = 1..6) with answer 2k and level k
PLAIN = [{"id": f"q{k}", "question": f"What is {k}+{k}?", "answer": 2 * k, "level": k} for k in range(1, 7)]

# TRL's conversational format: `prompt` is chat messages, the answer is in `solution`, and extra
# columns (`level`, `tags`) are for the reward functions
TRL = [
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "solution": "5", "level": 1, "tags": ["add"]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7*6?"}],
     "solution": "42", "level": 2, "tags": ["mul", "easy"]},
    {"prompt": [{"role": "user", "content": "What is 9-4?"}], "solution": "5", "level": 1, "tags": []},
    {"prompt": [{"role": "user", "content": "What is 8/2?"}], "solution": "4", "level": 3, "tags": ["div"]},
]


def write(kind: str, rows: list[dict], where: Path) -> Path:
    """`rows` as a dataset of `kind` under `where`; returns the path a recipe names."""
    ds = datasets.Dataset.from_list(rows)
    where.mkdir(parents=True, exist_ok=True)
    if kind in ("parquet", "csv"):
        path = where / f"data.{kind}"
        getattr(ds, f"to_{kind}")(str(path), **({"index": False} if kind == "csv" else {}))
    elif kind == "jsonl":
        path = where / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "disk":
        path = where / "disk"
        ds.save_to_disk(str(path))
    elif kind == "arrow":
        ds.save_to_disk(str(where / "tmp"))
        path = where / "data.arrow"
        shutil.copy(next((where / "tmp").glob("*.arrow")), path)
    else:  # a folder of data files: each file is a split
        path = where / "folder"
        path.mkdir()
        ds.to_parquet(str(path / "train.parquet"))
    return path


def hf(path: Path, **kw) -> TaskConfig:
    return TaskConfig(source="hf_datasets", path=str(path), **kw)


def by_id(source) -> dict:
    return {p.id: p for p in source.train + source.eval}


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv", "arrow", "disk", "folder"])
def test_every_format_gives_the_problems_and_the_split_of_the_jsonl_source(tmp_path, kind) -> None:
    path = write(kind, PLAIN, tmp_path / kind)
    cfg = hf(path, fields={"prompt": "question"}, eval_size=2, system_prompt="Be brief.")
    source = build_task(cfg)
    problems = by_id(source)
    assert sorted(problems) == ["q1", "q2", "q3", "q4", "q5", "q6"]
    q3 = problems["q3"]
    assert q3.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+3?"}]
    assert q3.answer == "6"  # an integer column becomes the answer's text
    assert q3.columns == {"level": 3, "question": "What is 3+3?"}
    assert len(source.eval) == 2 and not set(p.id for p in source.eval) & set(p.id for p in source.train)
    # the same rows as a JSONL task: the same held-out problems, in the same order (one split rule)
    jsonl = write("jsonl", PLAIN, tmp_path / "as-jsonl")
    reference = build_task(TaskConfig(source="jsonl", path=str(jsonl), fields={"prompt": "question"}, eval_size=2))
    assert [p.id for p in source.eval] == [p.id for p in reference.eval]
    assert [p.id for p in source.train] == [p.id for p in reference.train]


def test_trl_conversational_rows_and_their_columns_reach_a_reward(tmp_path, monkeypatch) -> None:
    path = write("parquet", TRL, tmp_path)
    source = build_task(hf(path, fields={"answer": "solution"}, eval_size=1, system_prompt="Answer with a number."))
    problems = {p.columns["question"]: p for p in source.train + source.eval}
    assert sorted(problems) == ["What is 2+3?", "What is 7*6?", "What is 8/2?", "What is 9-4?"]
    mul = problems["What is 7*6?"]
    assert mul.prompt == TRL[1]["prompt"]  # it has a system message: used as given
    assert problems["What is 2+3?"].prompt == [{"role": "system", "content": "Answer with a number."},
                                               {"role": "user", "content": "What is 2+3?"}]
    assert mul.answer == "42" and mul.columns == {"level": 2, "tags": ["mul", "easy"], "question": "What is 7*6?"}
    # a TRL-style reward function gets the columns as keyword lists
    (tmp_path / "hf_rewards.py").write_text(
        "def by_level(prompts, completions, level, tags, answer, **kw):\n"
        "    rows = zip(completions, answer, level, tags)\n"
        "    return [float(c.strip() == a) * l + len(t) / 10 for c, a, l, t in rows]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from adarl.rewards.callable import call

    assert call("hf_rewards:by_level", mul.prompt, " 42", mul.answer, dict(mul.columns)) == 2.2  # 1·2 + 2/10
    assert call("hf_rewards:by_level", mul.prompt, "41", mul.answer, dict(mul.columns)) == 0.2


# ---------------------------------------------------------------- splits


def test_split_and_eval_split_of_a_dataset_dict(tmp_path) -> None:
    train_rows, test_rows = PLAIN[:4], PLAIN[4:] + [PLAIN[0]]  # q1 is in both: it must leave training
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(train_rows),
                               "test": datasets.Dataset.from_list(test_rows)})
    dd.save_to_disk(str(tmp_path / "dd"))
    fields = {"prompt": "question"}
    source = build_task(hf(tmp_path / "dd", split="train", eval_split="test", fields=fields))
    assert [p.id for p in source.eval] == ["q5", "q6", "q1"] and [p.id for p in source.train] == ["q2", "q3", "q4"]
    capped = build_task(hf(tmp_path / "dd", split="train", eval_split="test", fields=fields, eval_size=2))
    assert [p.id for p in capped.eval] == ["q5", "q6"] and [p.id for p in capped.train] == ["q1", "q2", "q3", "q4"]
    with pytest.raises(ValueError, match="task.split: .* has the splits test, train; name the one to use"):
        build_task(hf(tmp_path / "dd", fields=fields))
    with pytest.raises(ValueError, match="has no split 'trian'; did you mean 'train'\\? \\(its splits: test, train"):
        build_task(hf(tmp_path / "dd", split="trian", fields=fields))
    with pytest.raises(ValueError, match="task.eval_split is the training split 'train'"):
        build_task(hf(tmp_path / "dd", split="train", eval_split="train", fields=fields))
    # a folder of data files: each file is a split
    folder = tmp_path / "files"
    folder.mkdir()
    datasets.Dataset.from_list(train_rows).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(test_rows).to_parquet(str(folder / "test.parquet"))
    from_files = build_task(hf(folder, split="train", eval_split="test", fields=fields))
    assert [p.id for p in from_files.eval] == ["q5", "q6", "q1"]
    assert [p.id for p in from_files.train] == ["q2", "q3", "q4"]
    # a single file is split 'train'
    single = write("parquet", PLAIN, tmp_path / "single")
    assert len(build_task(hf(single, split="train", fields=fields, eval_size=1)).train) == 5
    with pytest.raises(ValueError, match="has no split 'test'"):
        build_task(hf(single, split="test", fields=fields))


def test_eval_path_and_the_default_eval_size(tmp_path) -> None:
    fields = {"prompt": "question"}
    train = write("parquet", PLAIN, tmp_path / "train")
    held = write("csv", PLAIN[:2], tmp_path / "held")
    source = build_task(hf(train, eval_path=str(held), fields=fields))
    assert [p.id for p in source.eval] == ["q1", "q2"] and [p.id for p in source.train] == ["q3", "q4", "q5", "q6"]
    cfg = hf(train, fields=fields)  # eval_size unset: 6 distinct problems, so half are held out
    halved = build_task(cfg)
    assert (len(halved.eval), len(halved.train), cfg.eval_size) == (3, 3, 3)
    with pytest.raises(ValueError, match="task.eval_size is 6 but the data has only 6 distinct problems"):
        build_task(hf(train, fields=fields, eval_size=6))


# ---------------------------------------------------------------- bad rows and errors


def test_bad_rows_stop_the_load_or_are_skipped_and_counted(tmp_path) -> None:
    rows = [{"prompt": f"What is {k}+1?", "answer": str(k + 1)} for k in range(8)]
    rows[2] = {"prompt": None, "answer": "3"}  # row 3: no prompt
    rows[5] = {"prompt": "   ", "answer": "6"}  # row 6: an empty prompt
    path = write("parquet", rows, tmp_path)
    with pytest.raises(ValueError, match=r"data.parquet, row 3: prompt field 'prompt' must be a string .* got "
                                         r"NoneType.*set task.skip_bad_lines: true"):
        build_task(hf(path, eval_size=1))
    source = build_task(hf(path, eval_size=1, skip_bad_lines=True, max_bad_fraction=0.25))
    assert len(source.train) + len(source.eval) == 6 and source.skipped == 2
    assert "row 3" in source.first_bad
    questions = {p.columns["question"] for p in source.train + source.eval}
    assert questions == {f"What is {k}+1?" for k in (0, 1, 3, 4, 6, 7)}
    with pytest.raises(ValueError, match="2 of 8 rows are bad, more than task.max_bad_fraction \\(0.1\\)"):
        build_task(hf(path, eval_size=1, skip_bad_lines=True))


def test_a_mapping_to_no_column_names_the_columns(tmp_path) -> None:
    path = write("parquet", TRL, tmp_path)
    with pytest.raises(ValueError, match=r"task.fields.answer: .*data.parquet has no column 'solutoin'; did you "
                                         r"mean 'solution'\? \(its columns: prompt, solution, level, tags\)"):
        build_task(hf(path, fields={"answer": "solutoin"}))
    plain = write("csv", PLAIN, tmp_path / "plain")
    with pytest.raises(ValueError, match=r"task.fields.prompt: .* has no column 'prompt' \(its columns: id, "
                                         r"question, answer, level\)"):
        build_task(hf(plain))  # the default prompt column is missing: every row would be bad
    source = build_task(hf(plain, fields={"prompt": "question", "answer": "answer"}, eval_size=1))
    assert len(source.train) == 5  # an explicit default mapping to an existing column is fine


def test_datasets_never_reaches_the_network(tmp_path, monkeypatch) -> None:
    # a Hub id is read from the hub cache (tests/models/test_hub.py); not cached and offline, it is an error
    with pytest.raises(ValueError, match="task.path 'openai/gsm8k': this Hub dataset is not in the Hugging Face cache"):
        build_task(hf(Path("openai/gsm8k")))
    with pytest.raises(ValueError, match="task data not found: nowhere/a/b .*or a Hub dataset id"):
        hf(Path("nowhere/a/b"))
    with pytest.raises(ValueError, match="task.path is required for source 'hf_datasets'"):
        TaskConfig(source="hf_datasets")
    (tmp_path / "notes.txt").write_text("prompt\n")
    with pytest.raises(ValueError, match="cannot read a '.txt' file as a dataset"):
        build_task(hf(tmp_path / "notes.txt"))
    broken = tmp_path / "torn.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="torn.parquet: not readable as a dataset"):
        build_task(hf(broken))
    load_hf_datasets(hf(write("jsonl", PLAIN, tmp_path), fields={"prompt": "question"}, eval_size=1), 0)
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and datasets.config.HF_HUB_OFFLINE is True

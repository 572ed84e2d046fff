"""Named benchmark pools (issue 38): a mixed-difficulty task from several generators, each share's
counts in training and held out, pass@1 per share; the revisited and mixed recipes build."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from adarl.config import TaskConfig, load_recipe
from adarl.tasks import build_task
from adarl.tasks.mixture import pass1_by_share
from adarl.types import Problem

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ONE_DIGIT_PLUS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                  "allow_parentheses": False}
ONE_DIGIT_ANY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TWO_DIGIT_PLUS = {**ONE_DIGIT_PLUS, "min_digits": 2, "max_digits": 2}


def mixture(**over) -> dict:
    return {"source": "reasoning_gym", "mixture": [
        {"share": "easy", "name": "basic_arithmetic", "params": ONE_DIGIT_PLUS, "size": 12, "eval_size": 5},
        {"share": "middle", "name": "basic_arithmetic", "params": ONE_DIGIT_ANY, "size": 7, "eval_size": 9},
        {"share": "hard", "name": "chain_sum", "params": {"min_terms": 2, "max_terms": 2, "min_digits": 2,
                                                           "max_digits": 2}, "size": 4, "eval_size": 3},
    ], **over}


def test_each_share_has_its_counts_in_training_and_held_out() -> None:
    cfg = TaskConfig(**mixture())
    assert (cfg.size, cfg.eval_size) == (12 + 7 + 4, 5 + 9 + 3)
    task = build_task(cfg)
    assert Counter(p.columns["share"] for p in task.train) == {"easy": 12, "middle": 7, "hard": 4}
    assert Counter(p.columns["share"] for p in task.eval) == {"easy": 5, "middle": 9, "hard": 3}
    assert Counter(p.columns["source_dataset"] for p in task.eval) == {"basic_arithmetic": 14, "chain_sum": 3}
    ids = [p.id for p in task.train + task.eval]
    assert len(set(ids)) == len(ids)  # held out never trained, and no problem in two shares
    # the held-out shares are shuffled together, so a prefix (eval.size) mixes them too
    assert len({p.columns["share"] for p in task.eval[:6]}) > 1
    # the data seed alone decides the problems
    again = build_task(TaskConfig(**mixture()))
    assert [p.id for p in again.train] == [p.id for p in task.train]
    assert [p.id for p in again.eval] == [p.id for p in task.eval]


def test_a_share_whose_generator_runs_dry_says_what_to_change() -> None:
    # 1-digit additions: 121 distinct problems; asking 200 held out leaves none to train on
    bad = mixture()
    bad["mixture"][0]["eval_size"] = 200
    with pytest.raises(ValueError, match="share 'easy'.*lower its size or eval_size"):
        build_task(TaskConfig(**bad))


@pytest.mark.parametrize("over,message", [
    ({"size": 5}, "task.size is 5 but the task.mixture shares' sizes add up to 23"),
    ({"name": "chain_sum"}, "leave task.name and task.params out"),
    ({"source": "jsonl", "path": __file__}, "task.mixture needs task.source 'reasoning_gym'"),
])
def test_a_mixture_rejects_contradictions(over: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TaskConfig(**mixture(**over))


def test_share_labels_must_differ_and_be_metric_safe() -> None:
    twice = mixture()
    twice["mixture"][1]["share"] = "easy"
    with pytest.raises(ValidationError, match="share labels must differ"):
        TaskConfig(**twice)
    slash = mixture()
    slash["mixture"][0]["share"] = "a/b"
    with pytest.raises(ValidationError, match="share"):
        TaskConfig(**slash)
    # the sizes the validator filled in agree with themselves when config.yaml is read back
    cfg = TaskConfig(**mixture())
    assert TaskConfig(**cfg.model_dump()).size == 23


def test_pass1_by_share_by_hand() -> None:
    problems = [Problem(f"p{i}", "q", columns={"share": s}) for i, s in enumerate("aabbb")] + [Problem("x", "q")]
    # a: 1, 0 -> 0.5; b: 1, 1, 0 -> 2/3; the problem without a share counts only overall
    assert pass1_by_share(problems, [1, 0, 1, 1, 0, 1]) == pytest.approx({"eval/pass@1/a": 0.5,
                                                                         "eval/pass@1/b": 2 / 3})
    assert pass1_by_share(problems[5:], [1]) == {}


def test_the_named_pools_build_as_their_headers_say() -> None:
    mixed = load_recipe(RECIPES / "mixed_pool.yaml")
    task = build_task(mixed.task)
    assert Counter(p.columns["share"] for p in task.train) == {"easy": 40, "middle": 40, "hard": 40}
    assert Counter(p.columns["share"] for p in task.eval) == {"easy": 80, "middle": 80, "hard": 80}
    revisited = load_recipe(RECIPES / "revisited_pool.yaml")
    task = build_task(revisited.task)
    assert (len(task.train), len(task.eval)) == (128, 400)


def test_evaluation_reports_pass1_per_share(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from adarl.train import loop
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), rewards=[{"type": "short_answer"}])
    small = mixture()
    for share in small["mixture"]:
        share["size"], share["eval_size"] = 4, 2
    data["task"] = small
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    out = loop.evaluate(trainer)
    shares = {k: v for k, v in out.items() if k.startswith("eval/pass@1/")}
    assert set(shares) == {"eval/pass@1/easy", "eval/pass@1/middle", "eval/pass@1/hard"}
    # two held-out problems a share: each share's pass@1 is 0, 1/2 or 1, and they average to the overall
    assert all(v in (0.0, 0.5, 1.0) for v in shares.values())
    assert out["eval/pass@1"] == pytest.approx(sum(shares.values()) / 3)
    assert out["eval/problems"] == 6  # 3 shares × 2 held out: the health check weighs a fall by it

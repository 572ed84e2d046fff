"""The held-out split: one de-duplicated pool, split at random, so eval has the training distribution."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path

import pytest

from adarl.config import TaskConfig
from adarl.tasks import build_task
from adarl.tasks import reasoning_gym as rg_source
from adarl.tasks.base import dedupe, split_held_out
from adarl.types import Problem


def problem(i: int, pid: str | None = None) -> Problem:
    return Problem(id=pid or f"p{i}", prompt=[{"role": "user", "content": f"question {i}"}], answer=str(i))


def ids(problems: list[Problem]) -> list[str]:
    return [p.id for p in problems]


def total_variation(a: list[str | None], b: list[str | None]) -> float:
    """½ Σ_v |P_a(v) − P_b(v)| between the empirical distributions of two samples."""
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[v] / len(a) - cb[v] / len(b)) for v in set(ca) | set(cb))


# ---------------------------------------------------------------- the rule itself


def test_split_is_a_seeded_partition_of_the_distinct_problems() -> None:
    pool = [problem(i) for i in range(20)] + [problem(3), problem(7)]  # two repeats
    train, held = split_held_out(pool, 5, seed=11)
    assert len(held) == len(set(ids(held))) == 5
    # the 20 distinct problems, each in exactly one split; training keeps pool order
    assert sorted(ids(train) + ids(held)) == sorted(ids(dedupe(pool)))
    assert ids(train) == [p.id for p in dedupe(pool) if p.id not in set(ids(held))]
    again = split_held_out(pool, 5, seed=11)
    assert ids(again[0]) == ids(train) and ids(again[1]) == ids(held)
    assert {frozenset(ids(split_held_out(pool, 5, seed=s)[1])) for s in range(5)} != {frozenset(ids(held))}


def test_split_eval_is_a_uniform_draw_from_the_pool() -> None:
    # Over many seeds every one of 10 problems is held out (eval_size 3) with probability 3/10:
    # 2000 seeds give 600 expected per problem, binomial sd sqrt(2000·0.3·0.7) ≈ 20.5; ±90 is 4.4 sd.
    pool = [problem(i) for i in range(10)]
    counts = Counter(pid for s in range(2000) for pid in ids(split_held_out(pool, 3, seed=s)[1]))
    assert set(counts) == set(ids(pool))
    assert all(510 <= c <= 690 for c in counts.values()), counts


def test_split_never_trains_on_a_held_out_prompt() -> None:
    # p0..p9 and "copy-k" share their prompt with p_k but have another id: whichever of a pair is
    # held out, the other must not stay in training.
    pool = [problem(i) for i in range(10)] + [problem(i, pid=f"copy-{i}") for i in range(10)]
    train, held = split_held_out(pool, 4, seed=0)
    held_prompts = {json.dumps(p.prompt) for p in held}
    assert not held_prompts & {json.dumps(p.prompt) for p in train}
    assert not set(ids(held)) & set(ids(train))


def test_split_warns_when_the_pool_is_smaller_than_asked(caplog: pytest.LogCaptureFixture) -> None:
    pool = [problem(i) for i in range(7)]
    with caplog.at_level(logging.WARNING):
        train, held = split_held_out(pool, 3, seed=0, train_size=10, what="tiny")
    assert len(held) == 3 and len(train) == 4  # eval is filled first; training gets the other 4
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "tiny" in message and "only 7 distinct problems" in message and "13 asked" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train, held = split_held_out(pool, 3, seed=0, train_size=4)
    assert len(train) == 4 and not caplog.records


# ---------------------------------------------------------------- eval has the training distribution


class SkewedGenerator:
    """A tiny procedural task whose items are not equally likely, seeded per item like reasoning-gym.

    With probability 3/4 an item is one of 50 "common" problems (answers 1..5, ten problems
    each); otherwise one of a million "rare" problems, all with answer "0".
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __getitem__(self, idx: int) -> dict[str, str]:
        rng = random.Random(self.seed + idx)
        if rng.random() < 0.75:
            k = rng.randrange(50)
            return {"question": f"common {k}", "answer": str(1 + k % 5)}
        return {"question": f"rare {rng.randrange(10**6)}", "answer": "0"}


def test_held_out_answers_follow_the_training_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # size 200, eval_size 200. Old rule (eval = fresh items not in training): 200 draws hold ~150
    # common ones, which cover 50·(1 − e^(−150/50)) ≈ 47.5 of the 50 common problems, and ~50 rare
    # ones, so training's answer "0" share is ≈ 50/97.5 ≈ 0.51. Eval can then hold only the ≈ 2.5
    # common problems training missed: ≈ 197.5/200 ≈ 0.99 of it is "0", TV ≈ 0.48.
    # One pool of 400 distinct items split at random: 50 common + 350 rare (≈ 1400 draws, under
    # the 1600 allowed), "0" = 0.875 of the pool. Eval's "0" count z is hypergeometric with sd
    # sqrt(200·0.875·0.125·200/399) ≈ 3.3; the splits' "0" shares differ by (2z − 350)/200, sd ≈
    # 0.033, so 0.15 is 4.5 sd. The five common answers (≈ 5 items each in eval) add sampling
    # noise to the TV, still well under 0.15.
    monkeypatch.setattr(rg_source, "_create", lambda name, params, size, seed: SkewedGenerator(seed))
    for seed in range(3):
        task = build_task(TaskConfig(name="skewed", size=200, eval_size=200), seed=seed)
        train = [p.answer for p in task.train]
        held = [p.answer for p in task.eval]
        assert total_variation(train, held) < 0.15
        top, count = Counter(held).most_common(1)[0]
        assert top == "0" and abs(count / len(held) - train.count("0") / len(train)) < 0.15
        assert len(task.train) == 200 and len(task.eval) == 200
        assert not set(ids(task.train)) & set(ids(task.eval))


MIXED_DIGITS = {  # a + b with 1-digit (0..10) or 2-digit (0..100) operands, each half the time
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
    "operators": ["+"], "allow_parentheses": False, "allow_negation": False,
}


def test_reasoning_gym_held_out_has_the_training_share_of_small_sums() -> None:
    # The 1-digit half has only 11² = 121 problems, the 2-digit half 101² = 10201, of which 231 sum
    # to ≤ 20 and 121 (both operands ≤ 10) repeat a 1-digit problem: 110/10201 ≈ 1.1% are new small
    # sums. Old rule, size 1000: 500 1-digit draws cover 121·(1 − e^(−500/121)) ≈ 119 problems and
    # 500 2-digit draws give ≈ 488 distinct, so training has (119 + 0.011·488)/607 ≈ 20% sums ≤ 20;
    # eval can hold only the ≈ 2 missed 1-digit problems plus 1.1% of 2-digit ones: ≈ (2 + 2)/200
    # ≈ 2%. One pool of 1200 distinct: 121 1-digit + 1079 2-digit, (121 + 0.011·1079)/1200 ≈ 11%
    # small sums in both splits; eval's share (200 of 1200) has sd ≈ sqrt(0.11·0.89/200) ≈ 0.022.
    task = build_task(TaskConfig(name="basic_arithmetic", params=MIXED_DIGITS, size=1000, eval_size=200), seed=0)

    def small_share(problems: list[Problem]) -> float:
        return sum(int(p.answer or "0") <= 20 for p in problems) / len(problems)

    assert abs(small_share(task.eval) - small_share(task.train)) < 0.07  # old: ≈ 0.18
    assert 0.07 < small_share(task.train) < 0.15
    assert len(task.train) == 1000 and len(task.eval) == 200


def test_a_small_problem_space_warns_and_fills_eval_first(caplog: pytest.LogCaptureFixture) -> None:
    add1 = {**MIXED_DIGITS, "max_digits": 1}  # a + b, a and b in 0..10: exactly 121 problems
    with caplog.at_level(logging.WARNING):
        task = build_task(TaskConfig(name="basic_arithmetic", params=add1, size=300, eval_size=50), seed=0)
    # 1400 draws (4 × 350) of 121 equally likely problems miss one with probability
    # 121·(1 − 1/121)^1400 ≈ 121·e^(−11.6) ≈ 1e-3: all 121 are found; eval takes 50, training 71.
    assert len(task.eval) == 50 and len(task.train) == 71
    assert not set(ids(task.train)) & set(ids(task.eval))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("basic_arithmetic" in w and "only 121 distinct" in w and "350 asked" in w for w in warnings)
    with pytest.raises(ValueError, match=r"only 121 distinct problems .*task.eval_size is 121"):
        build_task(TaskConfig(name="basic_arithmetic", params=add1, size=10, eval_size=121), seed=0)


# ---------------------------------------------------------------- every source uses the rule


def test_jsonl_held_out_is_the_shared_rule(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i % 40}", "answer": str(i)}) + "\n" for i in range(50)))
    cfg = TaskConfig(source="jsonl", path=str(path), eval_size=8, data_seed=5)
    task = build_task(cfg)
    from adarl.tasks.jsonl import read_jsonl

    train, held = split_held_out(read_jsonl(path, cfg), 8, seed=5)
    assert ids(task.eval) == ids(held) and ids(task.train) == ids(train)
    assert len(task.train) == 40 - 8

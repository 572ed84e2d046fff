"""A mixed-difficulty task: shares of problems from different reasoning-gym generators.

``task.mixture`` lists the shares; each draws ``size + eval_size`` distinct problems from its
generator and splits them like a plain reasoning-gym task (`split_held_out`), so the held-out set
is mixed in the same proportions as training. Every problem carries its share's label in
``columns["share"]``, from which the trainer's evaluation reports greedy pass@1 per share
(``eval/pass@1/<share>``, `pass1_by_share`) beside the overall ``eval/pass@1``. A problem that an
earlier share already holds (two generators can ask the same question) is drawn again, so no
problem belongs to two shares. Each share's draws and split are seeded by ``task.data_seed`` and
its label. The held-out problems of all shares are shuffled together, so any prefix
(``eval.size``) is mixed too.

    task:
      source: reasoning_gym
      mixture:
        - {share: easy, name: basic_arithmetic, params: {...}, size: 40, eval_size: 80}
        - {share: hard, name: basic_arithmetic, params: {...}, size: 40, eval_size: 80}
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, split_held_out
from adarl.tasks.reasoning_gym import derive_seed, distinct_problems
from adarl.types import Problem

SHARE = "share"  # the column that names a problem's share


def load_mixture(cfg: TaskConfig, data_seed: int) -> TaskSource:
    """Training and held-out problems of every share of `cfg.mixture` (see the module doc)."""
    assert cfg.mixture is not None
    train: list[Problem] = []
    held: list[Problem] = []
    taken: set[str] = set()
    for m in cfg.mixture:
        wanted = m.size + m.eval_size
        pool = distinct_problems(m.name, m.params, wanted, derive_seed(data_seed, f"pool:{m.share}"), cfg, taken)
        if len(pool) <= m.eval_size:
            raise ValueError(f"task.mixture share '{m.share}': generator '{m.name}' gave only {len(pool)} distinct "
                             f"problems not in an earlier share, and its eval_size is {m.eval_size}: lower its "
                             "size or eval_size, or widen its params")
        for p in pool:
            p.columns[SHARE] = m.share
        taken.update(p.id for p in pool)
        share_train, share_held = split_held_out(pool, m.eval_size, derive_seed(data_seed, f"split:{m.share}"),
                                                 train_size=m.size, what=f"task.mixture share '{m.share}'")
        train += share_train
        held += share_held
    random.Random(derive_seed(data_seed, "mixture")).shuffle(held)
    return TaskSource(train=train, eval=held, name="+".join(m.share for m in cfg.mixture))


def pass1_by_share(problems: Sequence[Problem], greedy: Sequence[float]) -> dict[str, float]:
    """``eval/pass@1/<share>``: the mean of `greedy` (one 0/1 per problem) over each share's problems;
    {} when no problem names a share."""
    by_share: dict[str, list[float]] = {}
    for p, g in zip(problems, greedy, strict=True):
        if isinstance(p.columns.get(SHARE), str):
            by_share.setdefault(p.columns[SHARE], []).append(float(g))
    return {f"eval/pass@1/{share}": float(np.mean(v)) for share, v in sorted(by_share.items())}

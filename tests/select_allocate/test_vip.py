"""VIP (algorithms.md §2.11) by hand: the variance-minimising split and the GP prediction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adarl import registry
from adarl.allocate.vip import allocate as vip_allocate
from adarl.select.store import DifficultyStore
from adarl.types import Problem
from allocation_groups import group


def test_vip_allocation_minimises_the_variance_by_hand():
    # two prompts, C = 9, n_min = 4, n_max = 32, γ = 0: both start at 4, the 9th rollout goes where
    # a (n − 1)/n² drops most: a = p(1 − p); 4 → 5 lowers it by a (3/16 − 4/25) = 0.0275 a,
    # so to the larger a: p = 0.5 (a = 0.25) rather than p = 0.1 (a = 0.09)
    assert vip_allocate(np.array([0.1, 0.5]), 9, 4, 32, 0.0, "grpo") == [4, 5]
    # equal p̂: a uniform split; RLOO a/(n − 1) too
    assert vip_allocate(np.array([0.3] * 3), 24, 4, 32, 0.0, "rloo") == [8, 8, 8]
    # γ log p̂ pushes rollouts to the low-p̂ prompt: with γ = 1e-2, p̂ = 0.1 gains −γ ln 0.1 = 0.023 a rollout
    # beyond 0.09·(3/16 − 4/25) = 0.0025, against p̂ = 0.5's 0.25·0.0275 + 0.0069 = 0.0138
    assert vip_allocate(np.array([0.1, 0.5]), 9, 4, 32, 1e-2, "grpo") == [5, 4]
    # C < n_min·B: ⌊6/4⌋ = 1 prompt funded, the one of largest a (p = 0.5), with the 2 left over too
    assert vip_allocate(np.array([0.1, 0.5, 0.9]), 6, 4, 32, 0.0, "grpo") == [0, 6, 0]


def test_vip_predicts_an_unseen_prompt_from_a_similar_seen_one():
    ids = ["seen", "twin", "far"]
    texts = ["what is 12 plus 30", "what is 12 plus 30 ?", "name a prime greater than one hundred"]
    store = DifficultyStore(ids, problems=[Problem(q, t) for q, t in zip(ids, texts, strict=True)])
    store.update([group("seen", [1, 1, 1, 0])], 1)  # acc 3/4: logit ln 3 = 1.0986
    vip = registry.build("allocate", {"name": "vip", "distance": "words"})
    p = vip.predict(ids, store)
    # seen: K = 1 + jitter → μ = −1 + (ln 3 + 1)/(1 + 1e-4) ≈ ln 3: p ≈ 3/4
    assert p[0] == pytest.approx(0.75, abs=1e-3)
    # far shares no word: d = 1, k = exp(−½ (1/0.4)²) = 0.044 → μ = −1 + 0.044·2.0986: p = σ(−0.9076)
    assert p[2] == pytest.approx(1 / (1 + math.exp(0.9076)), abs=1e-3)
    assert p[2] < p[1] < p[0]  # the near twin is predicted close to the seen prompt
    # the default: prompts unrelated, so both unseen ones get the prior σ(−1) and the seen one its own 3/4
    alone = registry.build("allocate", {"name": "vip"}).predict(ids, store)
    assert alone[0] == pytest.approx(0.75, abs=1e-3) and alone[1] == alone[2] == pytest.approx(1 / (1 + math.e))

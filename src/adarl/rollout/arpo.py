"""ARPO's entropy-based branching after tool calls, and AEPO's entropy pre-monitoring and branch
penalty (algorithms.md §3.4 and §4.3 a–b), for the agent loop (rollout/agent/).

ARPO (Dong et al. 2025, "Agentic Reinforced Policy Optimization"; released code
`vllm_rollout_with_tools.py`, random-threshold form): a prompt's budget is G = n trajectories; it
starts M = round(G·initial_fraction) chains (8 of 16 in the scripts). The entropy of a model segment
(one turn) is the mean entropy of its first ≤ 20 tokens over log |V|; H_init is a chain's first
segment's, H_now its latest's. After a chain's tool turn is appended, while the prompt has free
slots, each of its beam − 1 (= 1) candidate branches is taken iff

    p = clip(U(0, 1) − w·(H_now − H_init), 0, 1) ≤ branch_probability        (w = 0.2, 0.5)

(a rise in entropy after the tool makes branching likelier). A branch copies the chain: its spans
(the same objects: a shared prefix, trained once with the mean advantage of the leaves under it),
its counters and its environment (`copy.deepcopy`; an environment that cannot be copied is not
branched, counted). A prompt with no live chain but free slots starts one fresh chain. The code
takes H over the top-10 log-probs of each token; adarl records the full distribution's entropy.

AEPO (Dong et al. 2025, "Agentic Entropy-Balanced Policy Optimization"; from the abstract, no code):
(a) pre-monitoring: one probe chain per prompt goes first; from its first segment's entropy H_q and
the mean post-tool segment entropy H̄_tool seen so far in this call (H_q itself before any), the
prompt gets m = clip(round(G·σ(κ(H_q − H̄_tool))), 1, G) global chains (the probe included) and the
remaining slots are left to branches; (b) a chain that branched at each of its last j tool steps
branches with probability threshold branch_probability·(1 − δ)^j (κ = 1, δ = 0.5). H̄_tool is kept
per call, not across steps, so a resumed run draws what an uninterrupted one would.

The U(0, 1) draws come from each chain's sampling key and turn: reproducible and resumable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np


def segment_entropy(entropies: list[float] | None, vocab: int, window: int = 20) -> float | None:
    """Mean entropy of a segment's first `window` tokens over log |V| (None: not recorded or empty)."""
    if not entropies:
        return None
    return float(np.mean(entropies[:window])) / math.log(max(vocab, 2))


@dataclass
class ArpoBranching:
    policy: Literal["arpo", "aepo"] = "arpo"
    initial_fraction: float = 0.5  # ARPO: M = round(G · f) chains start from the prompt
    entropy_weight: float = 0.2  # w
    branch_probability: float = 0.5
    beam: int = 2  # up to beam − 1 branches per chain per tool step
    kappa: float = 1.0  # AEPO (a)
    penalty: float = 0.5  # AEPO (b): δ
    window: int = 20  # tokens of a segment its entropy is read from

    def initial_chains(self, n: int) -> int:
        """Chains started from the prompt at once: ARPO's M, or AEPO's one probe."""
        if self.policy == "aepo":
            return min(1, n)
        return max(1, min(n, round(n * self.initial_fraction)))

    def global_chains(self, n: int, h_prompt: float, h_tool: float | None) -> int:
        """AEPO (a): m = clip(round(G·σ(κ(H_q − H̄_tool))), 1, G)."""
        h_tool = h_prompt if h_tool is None else h_tool
        return int(np.clip(round(n / (1.0 + math.exp(-self.kappa * (h_prompt - h_tool)))), 1, n))

    def branches(self, draws: list[float], h_now: float, h_init: float, streak: int) -> int:
        """How many of the beam − 1 candidates branch (`draws`: one U(0, 1) per candidate)."""
        threshold = self.branch_probability * ((1.0 - self.penalty) ** streak if self.policy == "aepo" else 1.0)
        return sum(float(np.clip(u - self.entropy_weight * (h_now - h_init), 0.0, 1.0)) <= threshold
                   for u in draws[: self.beam - 1])

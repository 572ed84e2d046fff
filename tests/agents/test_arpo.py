"""ARPO / AEPO branching after tool calls in the agent loop (rollout/arpo.py). The branch rule and
AEPO's global-chain count are checked by hand; the loop with a scripted generator whose entropies
make every branching decision certain."""

from __future__ import annotations

import math

import pytest

from adarl.rollout.agent import AgentGenerator
from adarl.rollout.arpo import ArpoBranching, segment_entropy
from adarl.rollout.tools import Calculator
from adarl.types import Problem, Request, Rollout, sampled_tokens, trainable_masks
from conftest import make_tiny_tokenizer
from test_agent import CALL, FirstTurnCalls


def test_the_branch_rule_by_hand():
    arpo = ArpoBranching(entropy_weight=0.2, branch_probability=0.5)
    # p = clip(u − w·(H_now − H_init)): u = .55, a rise of .5 -> .55 − .1 = .45 ≤ .5: branch; no rise: .55: no
    assert arpo.branches([0.55], h_now=0.6, h_init=0.1, streak=0) == 1
    assert arpo.branches([0.55], h_now=0.1, h_init=0.1, streak=0) == 0
    assert ArpoBranching(beam=3).branches([0.1, 0.2], 0.0, 0.0, 0) == 2  # beam − 1 candidates
    # AEPO's penalty: after one branching step in a row the threshold is .5·(1 − .5) = .25; ARPO ignores it
    aepo = ArpoBranching(policy="aepo", penalty=0.5)
    assert aepo.branches([0.3], 0.0, 0.0, streak=0) == 1 and aepo.branches([0.3], 0.0, 0.0, streak=1) == 0
    assert arpo.branches([0.3], 0.0, 0.0, streak=3) == 1


def test_aepo_global_chains_by_hand():
    aepo = ArpoBranching(policy="aepo", kappa=1.0)
    assert aepo.global_chains(8, 0.5, 0.5) == 4  # σ(0) = .5
    assert aepo.global_chains(8, 0.5 + math.log(3), 0.5) == 6  # σ(ln 3) = .75
    assert aepo.global_chains(8, 0.5, None) == 4  # no tool step seen yet: H̄_tool = H_q
    assert aepo.global_chains(8, -50.0, 0.0) == 1  # at least one chain
    assert aepo.initial_chains(8) == 1 and ArpoBranching(initial_fraction=0.5).initial_chains(8) == 4


def test_segment_entropy_reads_the_first_tokens():
    assert segment_entropy([1.0, 3.0, 100.0], vocab=math.e ** 2, window=2) == pytest.approx(1.0)  # mean 2 / ln e²
    assert segment_entropy(None, 10) is None and segment_entropy([], 10) is None


class Scripted:
    """Row with key k writes script[k][turn] with the given entropy per token; keys count up."""

    capabilities = frozenset({"stop_strings"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self, script):
        from adarl.config import RolloutConfig

        self.tokenizer, self.script, self.policy_version = make_tiny_tokenizer(), script, 0
        self.turn = {k: 0 for k in script}
        self.cfg, self.next_key = RolloutConfig(), 0

    def add_stop(self, stop):
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    def new_keys(self, requests):
        keys = list(range(self.next_key, self.next_key + sum(r.n for r in requests)))
        self.next_key += len(keys)
        return keys

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        out = []
        for req, key in zip(requests, keys, strict=True):
            text, entropy = self.script[key][self.turn[key]]
            self.turn[key] += 1
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if "<tool_call>" not in text:
                ids = ids + [self.tokenizer.eos_token_id]
            out.append(Rollout(req.prompt_id, ids, [-0.5] * len(ids), "stop", entropies=[entropy] * len(ids)))
        return out

    def close(self):
        pass


def test_a_chain_branches_after_a_tool_turn_where_entropy_rose():
    answer = ("The answer is 408.", 0.5)
    # chain 0: a call (entropy 0), a second call (entropy 3: a rise), then the answer; its branch (key 1)
    # answers at once; then no chain is live and one slot is free: a fresh chain (key 2)
    gen = Scripted({0: [(CALL % "12*34", 0.0), (CALL % "408*1", 3.0), answer], 1: [answer], 2: [answer]})
    problems = {"p": Problem("p", "What is 12 * 34?", answer="408")}
    # branch_probability 0: only a certain branch (p clipped to 0 by an entropy rise) is taken
    ag = AgentGenerator(gen, Calculator, problems, max_turns=4,
                        branching=ArpoBranching(initial_fraction=0.34, entropy_weight=100.0, branch_probability=0.0))
    chain, branch, fresh = ag.generate([Request("p", [1, 2], 3)])
    # the branch holds the chain's spans up to its second tool turn: model, tool turn, model, tool turn
    k = len(branch.spans) - 1
    assert k == 8 and all(a is b for a, b in zip(branch.spans[:k], chain.spans[:k], strict=True))
    assert chain.text == branch.text == fresh.text == "The answer is 408."
    assert ag.metrics()["branch/branches"] == 1 and ag.metrics()["branch/fresh_chains"] == 1
    assert sampled_tokens([chain, branch, fresh]) == len(chain) + len(fresh) + len(branch.spans[-1])
    assert trainable_masks([chain, branch])[1].sum() == len(branch.spans[-1])  # the shared turns train once
    assert ag.metrics()["branch/shared_token_fraction"] > 0


def test_arpo_trains_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    class CallsWithEntropy(FirstTurnCalls):
        capabilities = frozenset({"stop_strings"})
        metrics = staticmethod(dict)  # the contract: nothing to report

        def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
            out = super().generate(requests, greedy, max_new_tokens, stop_when, keys, max_tokens)
            for r in out:
                if r.spans[0].entropies is None:
                    r.spans[0].entropies = [0.0] * len(r)
            return out

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "backend": "hf",
                                "agent": {"max_turns": 2, "max_context_tokens": 512,
                                          "branching": {"initial_fraction": 0.34, "branch_probability": 1.0}}},
                       allocate={"name": "fixed", "n": 3}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    trainer.generator.generator = CallsWithEntropy(trainer.generator.generator)
    row = trainer.train_step()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    # per prompt: one chain, its certain branch after the tool turn, then a fresh chain for the last slot
    assert len(rollouts) == 6 and row["rollout/branch/branches"] == 2 and row["rollout/branch/fresh_chains"] == 2
    assert row["step_tokens"] == sampled_tokens(rollouts) < sum(len(r) for r in rollouts)


def test_agent_branching_needs_entropies(tiny_model_dir, tmp_path):
    from adarl.config import RecipeError, load_recipe
    from test_train import recipe_data, write_task

    data = recipe_data(tiny_model_dir, write_task(tmp_path),
                       rollout={"backend": "vllm", "agent": {"branching": {"policy": "aepo"}}})
    with pytest.raises(RecipeError, match="rollout.agent.branching needs backend: hf"):
        load_recipe(data=data)

"""Branching rollouts (TreeRL's EPTree): forks share their prefix span; tokens paid and trained once.
Expected trees, positions and counts are worked out by hand from the scripted entropies."""

from __future__ import annotations

import pytest

from adarl.config import RolloutConfig
from adarl.rollout.branching import BranchingGenerator, fork_points, split_at
from adarl.rollout.scheduler import RolloutScheduler
from adarl.types import Request, Rollout, Span, sampled_tokens, trainable_masks
from conftest import make_tiny_tokenizer

ROOT_IDS = [10, 11, 12, 13, 14]
ROOT_ENTROPY = [2.0, 0.1, 0.9, 0.5, 0.9]  # position 0 never forks: the top two are 2 and 4 (tied at 0.9, earliest)


class Scripted:
    """Roots are ROOT_IDS; a continuation from a prefix of length p writes [100 + p, 200 + p]."""

    capabilities = frozenset({"stop_strings"})
    metrics = staticmethod(dict)  # the contract: nothing to report
    cfg = RolloutConfig()  # the contract: the rollout section it was built with

    def __init__(self):
        self.tokenizer = make_tiny_tokenizer()
        self.policy_version = 0
        self.calls: list[list[Request]] = []

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(requests)
        out = []
        for req in requests:
            for _ in range(req.n):
                if req.prefix_ids:
                    p = len(req.prefix_ids)
                    out.append(Rollout(req.prompt_id, [100 + p, 200 + p], [-1.0, -1.0], "stop", entropies=[0.3, 0.3]))
                else:
                    out.append(Rollout(req.prompt_id, list(ROOT_IDS), [-1.0] * 5, "stop", entropies=list(ROOT_ENTROPY)))
        return out


def test_split_keeps_the_content_and_returns_the_prefix_spans():
    r = Rollout("p", finish_reason="stop", spans=[Span("model", [1, 2, 3], [-1.0] * 3, [0.5] * 3, [0] * 3),
                                                  Span("tool", [7]), Span("model", [4], [-1.0], [0.5], [0])])
    shared = split_at(r, 2)
    assert [s.ids for s in shared] == [[1, 2]] and [s.ids for s in r.spans] == [[1, 2], [3], [7], [4]]
    assert r.completion_ids == [1, 2, 3, 7, 4] and r.spans[1].logprobs == [-1.0] and r.spans[0] is shared[0]
    assert [s.ids for s in split_at(r, 4)] == [[1, 2], [3], [7]]  # a boundary: no new cut


def test_forks_at_the_highest_entropy_tokens():
    r = Rollout("p", ROOT_IDS, [-1.0] * 5, "stop", entropies=ROOT_ENTROPY)
    assert fork_points(r, 2) == [2, 4]
    with pytest.raises(ValueError, match="entropies"):
        fork_points(Rollout("p", [1, 2], [-1.0, -1.0], "stop"), 1)


def test_a_tree_of_n_leaves_shares_its_prefixes():
    gen = BranchingGenerator(Scripted(), roots=2, top_n=2, children=2)
    leaves = gen.generate([Request("p", [1], 5)], keys=None)
    # n = 5, 1 + N·T = 5: one root; forks at positions 2 and 4, two children each
    assert len(leaves) == 5
    root, *children = leaves
    assert root.completion_ids == ROOT_IDS
    assert [c.completion_ids for c in children] == [[10, 11, 102, 202]] * 2 + [[10, 11, 12, 13, 104, 204]] * 2
    assert children[0].spans[0] is root.spans[0] and children[2].spans[1] is root.spans[1]
    # paid once: the root's 5 tokens and 2 new ones per child
    assert sampled_tokens(leaves) == 5 + 4 * 2 and gen.metrics()["branch/sampled_tokens"] == 13
    assert gen.metrics()["branch/distinct_leaves_per_prompt"] == 3  # the root and the two forks' texts
    assert gen.metrics()["branch/shared_token_fraction"] == pytest.approx(1 - 13 / (5 + 2 * 4 + 2 * 6))
    # trained once: the prefix tokens are trainable in the root only
    assert [m.tolist() for m in trainable_masks(leaves)] == [[1] * 5, [0, 0, 1, 1], [0, 0, 1, 1],
                                                              [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    # the fork requests: one per fork point, its prefix pre-filled once for both children
    assert [(r.prefix_ids, r.n) for r in gen.generator.calls[1]] == [([10, 11], 2), ([10, 11, 12, 13], 2)]


def test_the_budget_pays_a_shared_prefix_once():
    result = RolloutScheduler(BranchingGenerator(Scripted(), roots=2, top_n=2, children=2)).complete(
        [Request("p", [1], 5)])
    assert result.tokens_spent == 13 and result.metrics["branch/leaves_per_prompt"] == 5


def test_branching_trains_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8,
                                "branching": {"roots": 1, "top_n": 2, "children": 2}},
                       allocate={"name": "fixed", "n": 5}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    row = trainer.train_step()
    leaves = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(leaves) == 10 and row["rollout/branch/leaves_per_prompt"] == 5
    assert row["step_tokens"] == sampled_tokens(leaves) < sum(len(r) for r in leaves)
    assert row["rollout/branch/shared_token_fraction"] > 0


def test_branching_needs_hf_and_no_async(tiny_model_dir, tmp_path):
    from adarl.config import RecipeError, load_recipe
    from test_train import recipe_data, write_task

    load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                 rollout={"branching": {}, "scheduler": {"mode": "partial"}}))
    for bad in ({"backend": "vllm"}, {"scheduler": {"mode": "async"}}, {"agent": {}}):
        with pytest.raises(RecipeError, match="rollout.branching needs"):
            load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), rollout={"branching": {}, **bad}))


def test_evaluation_samples_independently():
    # evaluation's callers (train/loop.py, evaluate.py) score with `unbranched(generator)`: no tree at evaluation
    from adarl.evaluate import score_problems
    from adarl.rollout.base import unbranched
    from adarl.types import Problem

    class Rewards:
        def score(self, groups, censor=True):
            for g in groups:
                g.correct = __import__("numpy").zeros(g.size)

    inner = Scripted()
    results = score_problems(unbranched(BranchingGenerator(inner, roots=1, top_n=2, children=2)), Rewards(),
                             [Problem("p", "q")], {"p": [1]}, n=5, progress=False)
    assert results[0].n == 5 and all(not r.prefix_ids for call in inner.calls for r in call)  # no forks

    # the trainer's held-out evaluation (train/loop.py: evaluate) on a tree sampler: no forks either
    from types import SimpleNamespace

    from adarl.config import EvalConfig
    from adarl.train.loop import evaluate

    class Stream:  # the sampling stream evaluation leaves where it was (keep_stream)
        def get_state(self):
            return {}

        def set_state(self, state):
            pass

    inner = Scripted()
    inner.rng = Stream()
    recipe = SimpleNamespace(eval=EvalConfig(samples=3), log=SimpleNamespace(progress=False))
    trainer = SimpleNamespace(step=1, recipe=recipe, task=SimpleNamespace(eval=[Problem("p", "q")]), rewards=Rewards(),
                              agent=None, generator=BranchingGenerator(inner, roots=1, top_n=2, children=2),
                              prompt_ids=lambda p: [1])
    assert evaluate(trainer)["eval/pass@3"] == 0.0
    assert inner.calls and all(not r.prefix_ids for call in inner.calls for r in call)


def test_short_chains_still_give_n_leaves():
    class Short(Scripted):
        capabilities = frozenset({"stop_strings"})
        metrics = staticmethod(dict)  # the contract: nothing to report

        def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
            self.calls.append(requests)
            return [Rollout(r.prompt_id, [10, 11], [-1.0] * 2, "stop", entropies=[1.0, 0.5]) if not r.prefix_ids
                    else Rollout(r.prompt_id, [50], [-1.0], "stop", entropies=[0.2])
                    for r in requests for _ in range(r.n)]

    gen = BranchingGenerator(Short(), roots=1, top_n=2, children=2)
    # n = 8: 8 // 5 = 1 root of 2 tokens; one fork point (position 1) gives 2 children; 5 fresh samples
    leaves = gen.generate([Request("a", [1], 8), Request("b", [2], 3)])
    assert [r.prompt_id for r in leaves] == ["a"] * 8 + ["b"] * 3  # each request's n leaves, consecutive
    assert [(r.prefix_ids, r.n) for r in gen.generator.calls[1]] == [([10], 2), ([10], 2), (None, 5)]


def test_forks_taken_latest_first_still_share_one_prefix():
    class LateFirst(Scripted):  # the highest entropy is at position 4, the second at 2: forks come 4, then 2
        capabilities = frozenset({"stop_strings"})
        metrics = staticmethod(dict)  # the contract: nothing to report

        def generate(self, requests, **kw):
            out = super().generate(requests, **kw)
            for r in out:
                if r.completion_ids == ROOT_IDS:
                    r.spans[0].entropies = [2.0, 0.1, 0.5, 0.3, 0.9]
            return out

    leaves = BranchingGenerator(LateFirst(), roots=1, top_n=2, children=2).generate([Request("p", [1], 5)])
    root = leaves[0]
    # every child's prefix is made of the root's own span objects: the 4 prefix tokens are paid once
    assert all(s in root.spans for child in leaves[1:] for s in child.spans[:-1])
    assert sampled_tokens(leaves) == 5 + 4 * 2


def test_partial_mode_carries_unfinished_branches(tiny_model_dir):
    """Partial mode with EPTree on the tiny model: the step's token budget cuts trees; their unfinished
    leaves are carried to later steps and continued, their shared prefix spans still shared; every
    token is paid once; and a checkpoint taken mid-way resumes to the same groups, sharing included."""
    import io

    import torch

    from adarl.config import ModelConfig, RolloutConfig, SchedulerConfig
    from adarl.models import chat_ids, load_model
    from adarl.rollout.hf import HfGenerator
    from adarl.types import shared_span_owners

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    cfg = RolloutConfig(max_new_tokens=16, temperature=1.0)
    prompts = [chat_ids(tok, [{"role": "user", "content": t}]) for t in ["What is 12+34?", "Hi", "abc"]]

    def build():
        gen = BranchingGenerator(HfGenerator(model, tok, cfg, seed=3), roots=1, top_n=2, children=2)
        return gen, RolloutScheduler(gen, SchedulerConfig(mode="partial", over_provision=1.0))

    def run(resume_at: int | None = None):
        gen, sched = build()
        groups, spent, carried = [], 0, 0
        for step in range(10):
            res = sched.run([Request(f"s{step}", prompts[step % 3], 5)], max_tokens=45)
            groups += res.groups
            spent += res.tokens_spent
            carried = max(carried, sched.metrics()["partial_rollouts_carried"])
            if step == resume_at:
                buffer = io.BytesIO()
                torch.save({"scheduler": sched.state_dict(), "generator": gen.state_dict()}, buffer)
                buffer.seek(0)
                state = torch.load(buffer, weights_only=False)
                gen, sched = build()
                gen.load_state_dict(state["generator"])
                sched.load_state_dict(state["scheduler"])
        held = [r for g in sched.buffer for r in g.rollouts]
        return groups, spent, carried, held

    groups, spent, carried, held = run()
    assert carried > 0 and len(groups) >= 3 and all(len(g.rollouts) == 5 for g in groups)
    leaves = [r for g in groups for r in g.rollouts]
    # paid once: the scheduler's count is every distinct sampled token, returned or still held
    assert spent == sampled_tokens(leaves + held)
    # a leaf continued after a cut still shares its prefix with its siblings
    continued = [g for g in groups if any(sum(s.sampled for s in r.spans) > 2 for r in g.rollouts)]
    assert any(shared_span_owners(g.rollouts) for g in continued)

    resumed, spent2, _, _ = run(resume_at=3)
    assert spent2 == spent and [g.request.prompt_id for g in resumed] == [g.request.prompt_id for g in groups]
    for a, b in zip(groups, resumed, strict=True):
        assert [r.completion_ids for r in a.rollouts] == [r.completion_ids for r in b.rollouts]
        assert sorted(map(sorted, shared_span_owners(a.rollouts).values())) == \
            sorted(map(sorted, shared_span_owners(b.rollouts).values()))


def test_an_avoided_token_is_drawn_from_the_rest_of_the_distribution(tiny_model_dir):
    """Inverse-CDF draws by hand, vocabulary of 3 with p = (0.5, 0.3, 0.2):
    row 0 avoids token 0: p' ∝ (0, 0.3, 0.2), cdf (0, 0.3, 0.5), u = 0.5 → target 0.25 → token 1;
    row 1 avoids nothing: cdf (0.5, 0.8, 1.0), u = 0.4 → target 0.4 → token 0 (the avoided one of row 0);
    row 2 avoids token 0 but it holds all the mass: nothing else can be drawn, so it is drawn.
    The recorded log-prob is the policy's own (log 0.3 for row 0), not the renormalised one."""
    import math

    import numpy as np
    import torch

    from adarl.config import ModelConfig, RolloutConfig
    from adarl.models import load_model
    from adarl.rollout.hf import HfGenerator

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    gen = HfGenerator(model, tok, RolloutConfig(temperature=1.0, top_p=1.0), seed=0)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    logits = torch.where(p > 0, torch.log(p), torch.tensor(-1e4))  # exp(−1e4) is 0 in float32
    draw = gen._sample(logits, False, np.array([0.5, 0.4, 0.9]), avoid=torch.tensor([0, -1, 0]))
    assert draw.tokens.tolist() == [1, 0, 0]
    assert draw.logprobs[0].item() == pytest.approx(math.log(0.3), abs=1e-6)
    assert gen._sample(logits, False, np.array([0.5, 0.4, 0.9])).tokens.tolist() == [0, 0, 0]  # no avoidance


def test_distinct_forks_leave_the_parents_path(tiny_model_dir):
    """EPTree with `distinct`: at a low temperature a child that resamples its fork point nearly always
    redraws its parent's token; with `distinct` every child's first own token differs from the parent's
    token there, and its prefix is still the parent's own spans (shared, not copied)."""
    from adarl.config import ModelConfig, RolloutConfig
    from adarl.models import chat_ids, load_model
    from adarl.rollout.hf import HfGenerator

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    prompts = [chat_ids(tok, [{"role": "user", "content": t}]) for t in ["What is 12+34?", "Hi", "abc"]]

    def leaves(distinct: bool):
        gen = BranchingGenerator(HfGenerator(model, tok, RolloutConfig(max_new_tokens=12, temperature=0.02), seed=1),
                                 roots=1, top_n=3, children=1, distinct=distinct)
        return gen.generate([Request(f"p{i}", ids, 4) for i, ids in enumerate(prompts)])

    def fork_tokens(out):  # (parent's token, child's token) at each fork point
        pairs = []
        for i in range(0, len(out), 4):
            root, *children = out[i:i + 4]
            for child in children:
                p = sum(len(s) for s in child.spans if any(s is t for t in root.spans))
                assert 1 <= p < len(root.completion_ids)  # a fork inside the root, its prefix shared
                pairs.append((root.completion_ids[p], child.completion_ids[p]))
        return pairs

    plain = fork_tokens(leaves(False))
    assert sum(a == b for a, b in plain) >= len(plain) // 2  # most forks redraw the parent's token
    distinct = leaves(True)
    assert len(distinct) == 12 and all(a != b for a, b in fork_tokens(distinct))


def test_only_hf_avoids_a_token():
    from adarl.rollout.vllm import VllmGenerator

    with pytest.raises(ValueError, match="avoid_token"):
        VllmGenerator.__new__(VllmGenerator).generate([Request("p", [1], 1, [2], avoid_token=3)])

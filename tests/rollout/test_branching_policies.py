"""LATR and TreePO tree samplers on scripted generators: the trees, prunes, shares and token counts
below are worked out by hand from the scripts."""

from __future__ import annotations

import math

import pytest

from adarl.rollout.branching import rouge_l
from adarl.rollout.latr import LatrGenerator, candidates, edit_distance, suffix_match
from adarl.rollout.scheduler import RolloutScheduler
from adarl.rollout.treepo import TreePOGenerator, has_repetition
from adarl.types import Request, Rollout, sampled_tokens, trainable_masks
from conftest import make_tiny_tokenizer

ROOT = [10, 11, 12, 13, 14, 15, 16, 17]  # 8 tokens, then EOS
# the root's two most likely tokens per position: eligible (p2 > .15 and p1 − p2 < .25) at 1 and 4 only
ROOT_TOP2 = {1: (11, 0.5, 99, 0.4), 3: (13, 0.6, 98, 0.3), 4: (77, 0.45, 14, 0.35)}


class Cfg:
    max_new_tokens = 8


class ScriptedLatr:
    """From the prompt: ROOT. From a prefix ending in 99: the root's own tokens (a look-alike child).
    Otherwise: 500 + position. Rows stop at 8 tokens ("stop") or at their request's limit ("length")."""

    capabilities = frozenset({"stop_strings", "top2"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self):
        self.tokenizer, self.cfg, self.policy_version = make_tiny_tokenizer(), Cfg(), 0
        self.record_top2, self.last_top2, self.calls = False, None, []

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(requests)
        out, tops = [], []
        for req in requests:
            prefix = list(req.prefix_ids or [])
            limit = min(req.max_new_tokens or 8, max_new_tokens or 8)
            for _ in range(req.n):
                if not prefix:
                    ids, top = list(ROOT), [ROOT_TOP2.get(q, (t, 0.9, 1, 0.05)) for q, t in enumerate(ROOT)]
                else:
                    ids = [ROOT[q] if prefix[-1] == 99 else 500 + q for q in range(len(prefix), limit)]
                    top = [(t, 0.9, 1, 0.05) for t in ids]
                finish = "stop" if len(prefix) + len(ids) >= 8 else "length"
                out.append(Rollout(req.prompt_id, ids, [-1.0] * len(ids), finish, entropies=[0.5] * len(ids)))
                tops.append(top)
        self.last_top2 = tops
        return out


def test_latr_filters_and_pruning_measures():
    top = [ROOT_TOP2.get(q, (t, 0.9, 1, 0.05)) for q, t in enumerate(ROOT)]
    # position 1: sampled the top-1 (11), the branch takes 99 at log .4; position 4 sampled the
    # runner-up (14), the branch takes the top-1 (77) at log .45; position 3 fails the relative gap
    assert candidates(ROOT, top, 0, 0.15, 0.25, "below") == [(1, 99, math.log(0.4)), (4, 77, math.log(0.45))]
    # the released filter (the default) keeps the other gap: p(top-1) − p(c) > τ_rel. Positions 1 and 4 have
    # gaps .5 − .4 = .1 and .45 − .35 = .1, under .25; position 3 has .6 − .3 = .3 > .25 and p(c) = .3 > .15, and
    # sampled its top-1 (13), so the branch takes the runner-up 98 at log .3
    assert candidates(ROOT, top, 0, 0.15, 0.25) == [(3, 98, math.log(0.3))]
    assert suffix_match([1, 2, 3, 4], [9, 9, 3, 4]) == 0.5 and suffix_match([1, 2], [2, 1]) == 0.0
    # LCS of (1 2 3 4) and (1 3 5 4) is 1 3 4: P = R = 3/4
    assert rouge_l([1, 2, 3, 4], [1, 3, 5, 4]) == pytest.approx(0.75) and rouge_l([], [1]) == 0.0


def test_latr_prunes_a_look_alike_and_keeps_a_different_branch():
    # the scripted root's eligible positions (1 and 4) are those of the gap-below reading
    gen = LatrGenerator(ScriptedLatr(), lookahead=(2,), rel_test="below")
    assert gen.generator.record_top2  # it asks the backend for the two most likely tokens
    leaves = gen.generate([Request("p", [1], 4)])
    root, child, *fresh = leaves
    assert root.completion_ids == ROOT
    # the branch at 4: forced 77, then 505 (lookahead stage: window (77, 505) vs (14, 15): kept), then to the end
    assert child.completion_ids == [10, 11, 12, 13, 77, 505, 506, 507]
    assert child.spans[0] is root.spans[0] and child.spans[1].logprobs[0] == pytest.approx(math.log(0.45))
    # the branch at 1 (forced 99, then the root's 12: window (99, 12) vs (11, 12), suffix 1/2 > .2) is pruned;
    # its slot finds no other eligible position, so two ordinary samples fill the group
    assert len(fresh) == 2 and all(f.completion_ids == ROOT for f in fresh)
    assert gen.metrics()["branch/pruned_per_prompt"] == 1
    # paid: root 8 + pruned branch 2 (forced + 1) + kept branch 4 (forced + 3) + 2 × 8 fresh = 30; in leaves 28
    assert sampled_tokens(leaves) == 28 and gen.last_discarded_tokens == 2
    assert RolloutScheduler(LatrGenerator(ScriptedLatr(), lookahead=(2,), rel_test="below")).complete(
        [Request("p", [1], 4)]).tokens_spent == 30
    assert [m.tolist() for m in trainable_masks([root, child])] == [[1] * 8, [0] * 4 + [1] * 4]


def test_latr_branches_where_the_released_filter_does_by_default():
    # rel_test "above" (sample_filter.py's ProbFilter): of the scripted root only position 3 (.6 vs .3, gap .3 >
    # .25) is eligible; the child takes 98 there, then the script's 504..507; at r = 2 its window (98, 504)
    # shares nothing with the root's (13, 14): kept. No other eligible position: two ordinary samples.
    root, child, *fresh = LatrGenerator(ScriptedLatr(), lookahead=(2,)).generate([Request("p", [1], 4)])
    assert child.completion_ids == [10, 11, 12, 98, 504, 505, 506, 507]
    assert child.spans[1].logprobs[0] == pytest.approx(math.log(0.3))
    assert len(fresh) == 2 and all(f.completion_ids == ROOT for f in fresh)


def test_latr_normalised_edit_distance_prunes_as_the_released_filter():
    # Levenshtein distance: (1 2 3 4) → (1 3 4 5) deletes 2 and appends 5: 2; nothing → (1 2): 2
    assert edit_distance([1, 2, 3, 4], [1, 3, 4, 5]) == 2 and edit_distance([], [1, 2]) == 2
    assert edit_distance([7, 8, 9], [7, 8, 9]) == 0 and edit_distance([1, 2], [2, 1]) == 2
    # the suffix and ROUGE-L tests off (thresholds of 1 never fire); at r = 2 the branch at 1 compares (99, 12)
    # with (11, 12): distance 1, 1/2 = 0.5 < 0.6, pruned; the branch at 4 compares (77, 505) with (14, 15): 2/2 = 1,
    # kept. Without the edit test both are kept.
    off = {"lookahead": (2,), "suffix_threshold": 1.0, "rouge_threshold": 1.0, "rel_test": "below"}
    gen = LatrGenerator(ScriptedLatr(), edit_threshold=0.6, **off)
    root, child, *fresh = gen.generate([Request("p", [1], 4)])
    assert child.completion_ids == [10, 11, 12, 13, 77, 505, 506, 507] and len(fresh) == 2
    assert gen.metrics()["branch/pruned_per_prompt"] == 1
    kept = LatrGenerator(ScriptedLatr(), **off)
    kept.generate([Request("p", [1], 4)])
    assert kept.metrics()["branch/pruned_per_prompt"] == 0


def test_latr_mix_schedule_sets_the_tree_share():
    inner = ScriptedLatr()
    gen = LatrGenerator(inner, lookahead=(2,))
    inner.policy_version = 250  # {0: 1, 100: .75, 200: .5, 300: .25}: .5 at step 250
    assert gen.tree_share() == 0.5
    inner.policy_version = 0
    gen.mix_schedule = {0: 0.25}  # round(4 · .25) = 1 tree leaf: no tree, four ordinary samples
    gen.generate([Request("p", [1], 4)])
    assert all(not r.prefix_ids for call in inner.calls for r in call)


class ScriptedSegments:
    """Every row writes distinct tokens (a counter); a row stops at `length` tokens in all."""

    capabilities = frozenset({"stop_strings"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self, length=8):
        self.tokenizer, self.cfg, self.policy_version = make_tiny_tokenizer(), Cfg(), 0
        self.length, self.next, self.calls = length, 1000, []

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(requests)
        out = []
        for req in requests:
            start = len(req.prefix_ids or [])
            limit = min(req.max_new_tokens or 8, self.length)
            for _ in range(req.n):
                ids = list(range(self.next, self.next + limit - start))
                self.next += len(ids)
                finish = "stop" if start + len(ids) >= self.length else "length"
                out.append(Rollout(req.prompt_id, ids, [-1.0] * len(ids), finish))
        return out


def test_treepo_segments_fan_out_to_n_leaves():
    gen = TreePOGenerator(ScriptedSegments(), width=2, segment=2, max_depth=3)
    leaves = gen.generate([Request("p", [1], 4)])
    # depth 1: 2 paths of 2 tokens; budget min(4, 2·2) = 4: 2 copies each; depth 2: 4 paths + 2 tokens,
    # budget min(4, 2·4) = 4: one copy each; depth 3 (max): each goes to the end (4 more tokens)
    assert len(leaves) == 4 and all(len(r.completion_ids) == 8 for r in leaves)
    assert [len(s) for s in leaves[0].spans] == [2, 2, 4]
    assert leaves[0].spans[0] is leaves[1].spans[0] and leaves[2].spans[0] is leaves[3].spans[0]
    assert leaves[0].spans[0] is not leaves[2].spans[0] and leaves[0].spans[1] is not leaves[1].spans[1]
    assert sampled_tokens(leaves) == 2 * 2 + 4 * 2 + 4 * 4 and gen.last_discarded_tokens == 0
    # each segment request asks for one more segment (the prefix counts): limits 2, then 4, then the end
    assert [r.max_new_tokens for r in gen.generator.calls[1]] == [4, 4]
    assert gen.generator.calls[2][0].max_new_tokens is None


def test_treepo_falls_back_to_a_finished_leaf():
    gen = TreePOGenerator(ScriptedSegments(length=3), width=2, segment=4, max_depth=6)
    leaves = gen.generate([Request("p", [1], 4)])
    # both first paths end at 3 tokens; two more leaves branch from a random cut of the first one
    assert len(leaves) == 4 and gen.metrics()["branch/fallbacks"] == 1
    first = leaves[0]
    assert leaves[2].spans[0] is first.spans[0] and leaves[3].spans[0] is first.spans[0]
    assert leaves[2].completion_ids[: len(first.spans[0])] == first.completion_ids[: len(first.spans[0])]


def test_repetition_check_counts_overlapping_substrings():
    assert has_repetition("ab" * 6, length=4, count=5) and not has_repetition("ab" * 6, length=4, count=6)
    assert not has_repetition("short", length=32, count=8)


@pytest.mark.parametrize("branching,advantage", [
    ({"policy": "latr", "lookahead": [2, 3], "abs_threshold": 0.0, "rel_threshold": 1.0, "rel_test": "below"},
     "treerl"),
    ({"policy": "treepo", "segment": 3, "max_depth": 3}, "treepo"),
])
def test_tree_policies_train_end_to_end(branching, advantage, tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "branching": branching},
                       allocate={"name": "fixed", "n": 4}, advantage={"name": advantage},
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    row = trainer.train_step()
    leaves = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(leaves) == 8 and row["rollout/branch/leaves_per_prompt"] == 4
    # every sampled token is paid once: those in leaves (a shared prefix once) and those dropped
    assert row["step_tokens"] == sampled_tokens(leaves) + row["rollout/branch/discarded_tokens"]
    assert row["rollout/branch/shared_token_fraction"] > 0  # some leaves share a prefix
    trainer.train_step()

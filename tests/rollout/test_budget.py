"""Per-step budgets hold in every scheduler mode, for every allocator, spares included.

A fake generator samples rows of a length fixed by each row's key (so a paused row continues
to the same end), one token per open row per decoding step, honouring `max_tokens` and
`stop_when` as the real backends do. The step loop is the trainer's: plan, generate (spares
beside the first stage in partial and async modes), verify, `more` until the allocator stops.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from adarl import registry
from adarl.allocate.base import plan_spares
from adarl.budget import Budget
from adarl.config import SchedulerConfig
from adarl.rollout import build_scheduler
from adarl.rollout.hf import Progress, row_keys
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Request, Rollout, merge

MAX_NEW = 12


class _Tokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["x" * len(s) for s in seqs]


class FakeGenerator:
    capabilities = frozenset({"stop_strings", "replica"})
    metrics = staticmethod(dict)  # the contract: nothing to report
    entropy_stats = None  # `replica` declares it (what a generation copy samples with)

    def __init__(self) -> None:
        self.policy_version = 0
        self.tokenizer = _Tokenizer()
        self.weight_listeners: list = []
        self.calls = 0

    def new_keys(self, requests):
        self.calls += 1
        return [hash((self.calls, i, j)) & 0xFFFFFFFF for i, r in enumerate(requests) for j in range(r.n)]

    def replica(self):
        return copy.copy(self)

    def pull_weights(self) -> None:
        pass

    def load_weights(self, weights=None, version=None) -> None:
        self.policy_version += 1
        for listener in self.weight_listeners:
            listener()

    @staticmethod
    def length(key: int) -> int:
        return 1 + key % MAX_NEW

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        keys, row_request = row_keys(requests, keys, greedy, self.new_keys)
        start = [len(requests[i].prefix_ids or []) for i in row_request]
        done = [0] * len(keys)
        progress = Progress([False] * len(keys), row_request)
        while not all(progress.row_finished):
            open_rows = [j for j, f in enumerate(progress.row_finished) if not f]
            if max_tokens is not None and progress.tokens + len(open_rows) > max_tokens:
                break
            for j in open_rows:
                done[j] += 1
                progress.tokens += 1
                if start[j] + done[j] >= self.length(keys[j]):
                    progress.row_finished[j] = True
            if stop_when is not None and stop_when(progress):
                break
        return [Rollout(requests[i].prompt_id, [1] * done[j], [0.0] * done[j],
                        "stop" if progress.row_finished[j] else "partial", policy_version=self.policy_version,
                        token_versions=[self.policy_version] * done[j])
                for j, i in enumerate(row_request)]


ALLOCATORS = [
    {"name": "fixed", "n": 8}, {"name": "dapo", "n": 4, "max_batches": 3},
    {"name": "dars", "n": 4, "n_max": 16, "schedule": "hardness"}, {"name": "xrpo", "n": 6, "bonus": "linear"},
    {"name": "gdro", "n_mean": 6}, {"name": "roc", "n": 4}, {"name": "brorl", "n": 64},
    {"name": "knapsack", "n": 6, "min_buffer_length": 2}, {"name": "reinforce_ada", "n": 4, "round_n": 3},
    {"name": "vip", "n": 6},
]
MODES = [{"mode": "sync"}, {"mode": "partial", "over_provision": 2.0},
         {"mode": "async", "eta": 1, "over_provision": 2.0}]


def run_steps(spec, mode, k, rollout_limit, token_limit, seed, steps=3, run_limit=None):
    rng = np.random.default_rng(seed)
    ids = [f"p{i}" for i in range(30)]
    problems = {q: Problem(q, "x") for q in ids}
    store = DifficultyStore(ids)
    allocator = registry.build("allocate", spec)
    generator = FakeGenerator()
    scheduler = build_scheduler(generator, SchedulerConfig(**mode))
    budget = Budget(run_limit, rollouts_per_step=rollout_limit, tokens_per_step=token_limit, expected_length=6)
    spent = []
    try:
        for step in range(steps):
            if budget.exhausted():
                break
            budget.start_step()
            chosen = [problems[q] for q in rng.choice(ids, size=allocator.candidates(k), replace=False)]
            counts = allocator.plan(chosen, store, budget)
            groups: dict[str, Group] = {}
            first = True
            while counts:
                requests = [Request(q, [0], n) for q, n in counts.items() if n > 0]
                if first and mode["mode"] != "sync":
                    extra = math.ceil(scheduler.cfg.over_provision * len(requests)) - len(requests)
                    spares = [problems[q] for q in rng.choice(ids, size=extra, replace=False)]
                    spare_counts = plan_spares(allocator, spares, requests, store, budget)
                    spare = [Request(q, [0], n) for q, n in spare_counts.items()]
                    rollouts = scheduler.run(requests, spare, max_tokens=budget.step_tokens_left(),
                                             run_tokens_left=budget.run_tokens_left()).rollouts
                else:
                    rollouts = scheduler.complete(requests, max_tokens=budget.step_tokens_left()).rollouts
                first = False
                m = scheduler.metrics()
                budget.spend(int(m["rollouts_started"]), tokens=int(m["tokens_generated"]))
                by_prompt: dict[str, list[Rollout]] = {}
                for r in rollouts:
                    assert r.finish_reason != "partial"
                    by_prompt.setdefault(r.prompt_id, []).append(r)
                fresh = []
                for q, rs in by_prompt.items():
                    c = rng.integers(0, 2, size=len(rs)).astype(float)
                    fresh.append(Group(problems[q], [0], rs, rewards=c[:, None], reward_names=("r",), correct=c))
                store.update(fresh, step)
                merge(groups, fresh)
                counts = allocator.more(list(groups.values()), store, budget)
            allocator.finish(list(groups.values()))
            spent.append((budget.step_rollouts, budget.step_tokens))
            generator.load_weights(None)
    finally:
        scheduler.close()
    return spent


@settings(max_examples=40, deadline=None, database=None)
@given(spec=st.sampled_from(ALLOCATORS), mode=st.sampled_from(MODES), k=st.integers(1, 6),
       rollout_limit=st.one_of(st.none(), st.integers(1, 120)),
       token_limit=st.one_of(st.none(), st.integers(1, 600)), seed=st.integers(0, 10_000))
def test_step_budgets_hold_in_every_mode(spec, mode, k, rollout_limit, token_limit, seed):
    for rollouts, tokens in run_steps(spec, mode, k, rollout_limit, token_limit, seed):
        assert rollout_limit is None or rollouts <= rollout_limit
        assert token_limit is None or tokens <= token_limit


@settings(max_examples=300, deadline=None, database=None)
@given(spec=st.sampled_from(ALLOCATORS), mode=st.sampled_from(MODES), k=st.integers(1, 6),
       token_limit=st.one_of(st.none(), st.integers(1, 200)), run_limit=st.integers(1, 400),
       seed=st.integers(0, 10_000))
def test_run_budget_holds_in_every_mode(spec, mode, k, token_limit, run_limit, seed):
    spent = run_steps(spec, mode, k, None, token_limit, seed, steps=8, run_limit=run_limit)
    assert sum(tokens for _, tokens in spent) <= run_limit, spent


def test_the_last_step_gets_what_the_run_has_left():
    budget = Budget(max_tokens=300, tokens_per_step=128)
    budget.start_step()
    assert budget.step_tokens_left() == 128  # min(128 a step, 300 the run)
    budget.spend(16, tokens=126)
    assert budget.step_tokens_left() == 2 and budget.run_tokens_left() == 174
    budget.start_step()  # 174 left > 126 the step before spent: not the last
    assert not budget.exhausted() and budget.step_tokens_left() == 128
    budget.spend(16, tokens=128)
    budget.start_step()  # 300 - 254 = 46 left <= 128: this step gets them all and is the last
    assert budget.step_tokens_left() == 46 and budget.last_step
    budget.spend(4, tokens=40)
    assert budget.step_tokens_left() == 6 and budget.exhausted()  # 294 < 300, but no step follows the last
    # spares are planned on a view with the needed requests reserved: those come off the run's rest too
    fresh = Budget(max_tokens=100)
    fresh.start_step()
    fresh.spend(2, tokens=60)
    assert fresh.reserve(2, 30).step_tokens_left() == 10  # 100 - 60 - 30
    # a resumed run knows whether its next step is the last
    again = Budget(max_tokens=300, tokens_per_step=128)
    again.load_state_dict(budget.state_dict() | {"total_tokens": 254, "step_tokens": 128})
    again.start_step()
    assert again.last_step and again.step_tokens_left() == 46


def test_spares_get_the_allocators_count_within_the_budget():
    # DARS plans n = 4 for every prompt. 3 needed prompts reserve 12 rollouts of the 20 allowed,
    # so of 4 spares only 8 rollouts fit: largest remainder over equal wants gives 2 each.
    store = DifficultyStore([f"p{i}" for i in range(10)])
    dars = registry.build("allocate", {"name": "dars", "n": 4})
    budget = Budget(rollouts_per_step=20)
    budget.start_step()
    requests = [Request(f"p{i}", [0], 4) for i in range(3)]
    spares = [Problem(f"p{i}", "x") for i in range(3, 7)]
    assert plan_spares(dars, spares, requests, store, budget) == {"p3": 2, "p4": 2, "p5": 2, "p6": 2}
    # unlimited: each spare gets the allocator's own n (the old code gave the needed requests' median)
    assert plan_spares(dars, spares, requests, store, Budget()) == {f"p{i}": 4 for i in range(3, 7)}


def test_token_cap_stops_generation_before_passing_it():
    gen = FakeGenerator()
    scheduler = build_scheduler(gen, SchedulerConfig(mode="sync"))
    out = scheduler.complete([Request("p", [0], 8)], max_tokens=20).rollouts
    m = scheduler.metrics()
    assert m["tokens_generated"] <= 20
    assert m["rollouts_started"] == 8
    assert len(out) + m["rollouts_cut_by_budget"] == 8  # cut rows are left out, never scored


SCHEDULER_MODES = ({"mode": "sync"}, {"mode": "partial", "over_provision": 2.0},
                   {"mode": "async", "eta": 1, "over_provision": 2.0})


def train_tiny(model_dir, tmp_path, budget: dict, mode: dict, name: str) -> list[dict]:
    """The metrics rows of a run on the tiny model: 4 prompts × 4 rollouts of up to 8 tokens a step."""
    import json

    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    data = recipe_data(model_dir, write_task(tmp_path), budget={"prompts_per_step": 4, **budget},
                       allocate={"name": "fixed", "n": 4}, log={"tensorboard": False, "progress": False},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "scheduler": mode})
    if mode["mode"] != "sync":
        data["loss"] = {"name": "decoupled_ppo"}
    Trainer(load_recipe(data=data), tmp_path / name).run()
    assert (tmp_path / name / "final").is_dir()
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_trainer_holds_the_token_cap_in_every_mode(tiny_model_dir, tmp_path):
    """End to end on the tiny model: 4 prompts × 4 rollouts of up to 8 tokens want up to 128 tokens a
    step; tokens_per_step 40 must hold in every step of every mode, and the runs must finish."""
    for mode in SCHEDULER_MODES:
        rows = train_tiny(tiny_model_dir, tmp_path, {"max_steps": 4, "tokens_per_step": 40}, mode, mode["mode"])
        assert len(rows) == 4, mode
        assert all(r["step_tokens"] <= 40 for r in rows), [r["step_tokens"] for r in rows]
        assert sum(r["step_tokens"] for r in rows) > 0
        # the budget binds: fewer than the 16 rollouts a step would start without it
        assert min(r["step_rollouts"] for r in rows) < 16, [r["step_rollouts"] for r in rows]


def test_run_token_budget_is_a_cap_in_every_mode(tiny_model_dir, tmp_path):
    """budget.max_tokens 300 is not a multiple of a step's spend: the last step gets what is left.

    4 prompts × 4 rollouts of up to 8 tokens want up to 128 tokens a step. Without a cap the third
    step of a sync run (the tiny random model almost never stops before 8 tokens) would end at
    about 3 × 128 = 384 > 300. With it, the step that starts with no more left than the step before
    spent gets the rest (at 8 tokens a rollout, 44 left gives each of the 4 prompts ⌊11/8⌋ = 1
    rollout) and is the last; what flooring leaves is under one rollout per prompt, 4 × 8 = 32.
    """
    for mode in SCHEDULER_MODES:
        rows = train_tiny(tiny_model_dir, tmp_path, {"max_steps": None, "max_tokens": 300}, mode, mode["mode"])
        spent = [r["step_tokens"] for r in rows]
        assert rows[-1]["tokens"] == sum(spent) <= 300, (mode, spent)
        if mode["mode"] == "sync":
            assert rows[-1]["tokens"] > 300 - 32 and spent[-1] < 128, spent


def test_a_step_that_can_pay_for_no_rollout_ends_a_token_budgeted_run(tiny_model_dir, tmp_path):
    """tokens_per_step 4 for 4 prompts × 4 rollouts of 8 expected tokens: each prompt's share is 1 token,
    ⌊1/8⌋ = 0 rollouts, so a step generates and trains nothing. Every step would do the same; a run with
    a token budget ends after the first such step instead of running max_steps (or, without one, forever)."""
    rows = train_tiny(tiny_model_dir, tmp_path, {"max_steps": 20, "max_tokens": 1000, "tokens_per_step": 4},
                      {"mode": "sync"}, "run")
    assert [(r["step"], r["tokens"]) for r in rows] == [(1, 0)]

"""Pilot-Commit (algorithms.md §2.7), step by step by hand: which pilots survive, what is committed,
what trains, and the buffer's staleness limit; a resume that matches; a run through the trainer."""

from __future__ import annotations

import json

import numpy as np

from adarl import registry
from adarl.allocate.pilot_commit import balanced
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout, merge


def verified(pid: str, correct: list[int]) -> Group:
    rollouts = [Rollout(pid, [1, 2], [-0.5, -0.5], "stop", text=str(c)) for c in correct]
    c = np.array(correct, dtype=np.float64)
    return Group(Problem(pid, pid), [7], rollouts, rewards=c[:, None], reward_names=("acc",), correct=c)


IDS = [f"q{i}" for i in range(12)]


def setup(**kw):
    pc = registry.build("allocate", {"name": "pilot_commit", "pilot_n": 4, "commit_n": 4, **kw})
    return pc, DifficultyStore(IDS), Budget()


def test_pilots_survive_in_the_band_and_are_committed_with_new_rollouts():
    pc, store, budget = setup()
    assert pc.candidates(2) == 6  # gen_multiplier 3 · B
    problems = [Problem(q, q) for q in IDS[:6]]
    assert pc.plan(problems, store, budget) == {q: 4 for q in IDS[:6]}  # step 1: pilots only, buffer empty
    # pilot accuracies 0, 1/4, 2/4, 3/4, 1, 2/4: the band [0.25, 0.75] keeps q1, q2, q3, q5
    pilots = [verified(q, c) for q, c in zip(IDS[:6], [[0] * 4, [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1] * 4,
                                                         [0, 1, 0, 1]], strict=True)]
    commits = pc.more(pilots, store, budget)
    assert set(pc.buffer) == {"q1", "q2", "q3", "q5"} - set(commits) and len(commits) == 2  # B = 2 committed
    assert all(n == 4 for n in commits.values()) and set(commits) <= {"q1", "q2", "q3", "q5"}
    new = [verified(q, [1, 0, 1, 0]) for q in commits]
    pilot_of = {g.problem.id: (list(g.rollouts), g.correct.tolist()) for g in pilots}  # before merging
    groups: dict = {}
    merge(groups, pilots)
    merge(groups, new)  # as the trainer does: a prompt's stages join one group
    assert pc.more(list(groups.values()), store, budget) == {}  # B prompts committed: the step is done
    trained = pc.finish(list(groups.values()))
    # only committed prompts train, each as its 4 pilot rollouts + 4 new ones; pilots alone never
    assert sorted(g.problem.id for g in trained) == sorted(commits) and all(g.size == 8 for g in trained)
    for g in trained:
        rollouts, correct = pilot_of[g.problem.id]
        assert all(a is b for a, b in zip(g.rollouts[:4], rollouts, strict=True))
        assert g.correct.tolist() == correct + [1, 0, 1, 0]


def test_the_buffer_commits_next_step_and_forgets_after_k():
    pc, store, budget = setup(max_off_steps=1)
    pc.candidates(1)
    pc.plan([Problem(q, q) for q in IDS[:3]], store, budget)
    pilots = [verified("q0", [1, 0, 1, 0]), verified("q1", [0, 1, 1, 0]), verified("q2", [0, 0, 0, 0])]
    (first,) = pc.more(pilots, store, budget)  # one committed in the step; the other waits
    waiting = ({"q0", "q1"} - {first}).pop()
    pc.finish([verified(first, [1] * 4)])
    # step 2: the waiting survivor is committed first, fresh prompts are piloted beside it
    counts = pc.plan([Problem(q, q) for q in IDS[3:6]], store, budget)
    assert counts == {waiting: 4, "q3": 4, "q4": 4, "q5": 4}
    # a survivor older than K + 1 = 2 steps is dropped unpopped
    pc.buffer = {"old": (verified("old", [1, 0, 0, 1]), pc.t - 2), "fresh": (verified("fresh", [1, 0, 0, 1]), pc.t)}
    pc.candidates(5)
    counts = pc.plan([Problem("q9", "q9")], store, budget)
    assert "old" not in counts and counts["fresh"] == 4


def test_max_variance_pops_the_most_mixed_pilot_first_and_balanced_subsample():
    pc, store, budget = setup(sampling="max_variance")
    pc.buffer = {"a": (verified("a", [1, 0, 0, 0]), 1), "b": (verified("b", [1, 1, 0, 0]), 1),
                 "c": (verified("c", [1, 1, 0, 0]), 2)}
    pc.t = 2
    pc.candidates(2)
    counts = pc.plan([], store, budget)
    assert set(counts) == {"b", "c"}  # std 0.5 beats a's 0.433; b and c tie, the newest (c) first but both fit
    assert balanced(verified("x", [1, 1, 1, 0, 0, 1]), 4) == [0, 1, 3, 4]


def test_state_dict_resumes_the_buffer():
    pc, store, budget = setup()
    pc.candidates(1)
    pc.plan([Problem(q, q) for q in IDS[:2]], store, budget)
    pc.more([verified("q0", [1, 0, 1, 0]), verified("q1", [1, 1, 0, 0])], store, budget)
    state = json.loads(json.dumps(pc.state_dict()))  # plain data
    other, _, _ = setup()
    other.load_state_dict(state)
    assert set(other.buffer) == set(pc.buffer) and other.t == pc.t
    (g, stamp), (h, stamp2) = pc.buffer["q1" if "q1" in pc.buffer else "q0"], other.buffer[next(iter(pc.buffer))]
    assert g.correct.tolist() == h.correct.tolist() and [r.completion_ids for r in g.rollouts] == \
        [r.completion_ids for r in h.rollouts] and stamp == stamp2
    pc.candidates(1), other.candidates(1)
    assert pc.plan([Problem("q5", "q5")], store, budget) == other.plan([Problem("q5", "q5")], store, budget)


def test_pilot_commit_trains_through_the_trainer(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 2},
                       log={"tensorboard": False, "progress": False})
    data["allocate"] = {"name": "pilot_commit", "pilot_n": 2, "commit_n": 2, "p_lo": 0.0, "p_up": 0.0}
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    rows = [trainer.train_step() for _ in range(3)]
    # with a band of [0, 1] every pilot survives: step 1 pilots 6 prompts and commits 2 of them
    assert rows[0]["allocate/pilots"] == 6 and rows[0]["allocate/committed"] == 2
    # the two committed prompts were piloted this step: 2 pilot + 2 new rollouts each, the others 2
    assert rows[0]["trained_groups"] == 2 and rows[0]["rollouts_per_prompt_max"] == 4
    assert rows[0]["rollouts_per_prompt_hist"] == {"2": 4, "4": 2}
    assert rows[1]["allocate/committed"] == 2 and rows[1]["trained_groups"] == 2

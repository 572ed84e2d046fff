"""Hints for all-failed groups (hints/): SEELE's IRT fit, ADHint's sub-group advantages and Guide's
hint-free ratio, by hand; the rung inside the trainer with exact token accounting and a resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from adarl import registry
from adarl.hints.base import prefix_of
from adarl.hints.seele import fit_difficulty
from adarl.tasks.reasoning_gym import arithmetic_solution
from adarl.types import Batch, Group, Problem, Rollout, Span
from test_rollout_record import applied_gradient, tiny_model


def test_irt_fit_by_hand():
    # symmetric points around .5 with one success in two each: σ(10(.3 − b)) + σ(10(.7 − b)) = 1 at b = .5
    assert fit_difficulty([(0.3, 1, 2), (0.7, 1, 2)], slope=10.0) == pytest.approx(0.5, abs=1e-9)
    # one point, 1 of 4 at λ = .5: σ(10(.5 − b)) = 1/4, so b = .5 + ln 3 / 10
    assert fit_difficulty([(0.5, 1, 4)], slope=10.0) == pytest.approx(0.5 + math.log(3) / 10, abs=1e-9)
    assert fit_difficulty([(0.0, 0, 8), (0.5, 0, 2)], 10.0) == math.inf  # never solved: no finite b
    seele = registry.build("hints", {"name": "seele"})
    assert seele.ratio("p") == 0.5  # round 1: λ_1
    seele.difficulty["p"] = 0.5 + math.log(3) / 10
    assert seele.ratio("p") == pytest.approx(0.5 + math.log(3) / 10)  # acc* = .5: λ = b
    seele.difficulty["p"] = math.inf
    assert seele.ratio("p") == 1.0  # clipped: the whole solution


def test_hint_sources():
    assert arithmetic_solution("4 - 1 - 7") == "4 - 1 = 3; 3 - 7 = -4. The answer is -4."
    assert arithmetic_solution("3 * 4") is None
    assert prefix_of("a b c d", 0.5) == "a b" and prefix_of("a b c d", 0.0) == ""


def test_adhint_advantage_by_hand():
    plain = [Rollout("p", [1], [-1.0], "stop") for _ in range(4)]
    hinted = [Rollout("p", finish_reason="stop", spans=[Span("hint", [7, 8]), Span("model", [2], [-1.0])])
              for _ in range(4)]
    correct = np.array([0, 0, 0, 0, 1, 1, 0, 0], dtype=float)
    g = Group(Problem("p", "q", "1"), [1], plain + hinted, correct[:, None].copy(), ("r",), correct)
    adv = registry.build("advantage", {"name": "adhint"})(Batch([g]))
    # plain sub-group: all equal -> 0; hinted: mean .5, unbiased std √(1/3): ±.5/√(1/3) = ±.866,
    # scaled by 1 − acc_hint + acc_plain = 1 − .5 + 0 = .5
    np.testing.assert_allclose(adv[:4], 0.0)
    np.testing.assert_allclose(adv[4:], 0.5 * np.array([1, 1, -1, -1]) * 0.5 / math.sqrt(1 / 3), rtol=1e-5)


@pytest.mark.model
def test_guide_ratio_is_over_the_hinted_behaviour():
    model = tiny_model()
    prompt, completion = [1, 2, 3], [6, 7, 8]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    lp = [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion)]
    # the hinted behaviour made each token a little likelier: ℓ_beh = ℓ_θ + .1, so ρ = e^−.1 (inside the clip)
    r = Rollout("p", completion, [x + 0.1 for x in lp], "stop", guided=True)
    g = Group(Problem("p", "q", "1"), prompt, [r], np.ones((1, 1)), ("r",), np.ones(1))
    batch = Batch([g], advantages=np.array([1.0]))
    # by hand: loss = −Σ_t ρ_t·A / 3, so ∇ = −Σ_t ρ_t ∇ℓ_θ(t) / 3 with ρ_t = e^−.1 at the current θ
    model.zero_grad()
    live = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    total = sum(-torch.exp(live[len(prompt) - 1 + t, tok] - (lp[t] + 0.1)) / 3 for t, tok in enumerate(completion))
    total.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = applied_gradient(model, batch)
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=1e-6), name
    assert Rollout.from_state(r.state_dict()).guided  # it survives a checkpoint


def write_hard_task(tmp_path):
    path = tmp_path / "hard.jsonl"
    with path.open("w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": f"Compute {i}", "answer": str(90000 + i),
                                "solution": f"It is {90000 + i}. The answer is {90000 + i}."}) + "\n")
    return path


@pytest.mark.parametrize("hints,advantage", [({"name": "guide", "source": "solution"}, "grpo"),
                                             ({"name": "seele", "rounds": 2, "per_round": 2}, "grpo"),
                                             ({"name": "adhint"}, "adhint")])
def test_the_hint_rung_trains_end_to_end(hints, advantage, tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer"}], allocate={"name": "fixed", "n": 4}, hints=hints,
                       advantage={"name": advantage}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    row = trainer.train_step()
    groups = trainer.last_groups
    assert row["hints/groups"] == 2  # the random tiny model fails every prompt: both groups get hints
    mixed = sum(0 < g.correct.sum() < g.size for g in trainer.last_groups)
    assert row["hints/groups_mixed"] == mixed and row["hints/groups_solved"] <= 2
    rollouts = [r for g in groups for r in g.rollouts]
    marked = [r for r in rollouts if r.guided or r.spans[0].role == "hint"]
    if hints["name"] == "guide":  # the guided rollouts replaced the failed ones
        assert len(rollouts) == 8 and all(r.guided for r in rollouts)
        # the replaced failures were paid for too: the step's tokens exceed those it trains on
        assert row["step_tokens"] > sum(len(r) for r in rollouts)
    else:  # they joined them: SEELE 2 rounds × 2 rollouts, ADHint as many as the group has
        assert len(rollouts) == 8 + (2 * 2 * 2 if hints["name"] == "seele" else 8)
        hint = marked[0].spans[0]
        assert hint.role == "hint" and not hint.sampled and trainer.tokenizer.decode(hint.ids).startswith("It is")
        # exact accounting: every rollout is still here, and only sampled tokens were paid for
        assert row["step_tokens"] == sum(len(r) for r in rollouts) < sum(len(r.completion_ids) for r in rollouts)
    if hints["name"] == "seele":
        assert trainer.hints.difficulty  # fitted per problem, kept in the checkpoint state
        state = trainer.hints.state_dict()
        fresh = registry.build("hints", hints)
        fresh.load_state_dict(state)
        assert fresh.difficulty == trainer.hints.difficulty


def test_the_ladder_is_logged_stored_and_drawn(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.report import Group as ReportGroup
    from adarl.report import _heatmap_panel
    from adarl.runs import load_run
    from adarl.select.store import RUNGS
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer"}], allocate={"name": "fixed", "n": 2},
                       hints={"name": "adhint"}, advantage={"name": "adhint"},
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()]
    hinted = RUNGS.index("hinted")
    # the tiny model solves nothing: every group reaches the hint rung (unless its hinted rollouts all
    # failed too, still the hint rung), in the log, the store and the step metrics
    assert [r["rung"] for r in rows] == [hinted] * 4
    assert all(trainer.store.rung[trainer.store.index[r["prompt_id"]]] == hinted for r in rows)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("ladder/hinted") for m in metrics if m.get("step")] == [2.0, 2.0]
    image, caption = _heatmap_panel(ReportGroup("adhint", [load_run(tmp_path / "run")]))
    assert image is not None and "ladder rung" in caption  # a third map: the rungs


def solved_group(pid: str, prompt: str, texts: list[str], correct: list[int], system: str | None = None) -> Group:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    rollouts = [Rollout(pid, [1], [0.0], "stop", text=t) for t in texts]
    return Group(Problem(pid, messages, "1"), [1], rollouts, np.array(correct, float)[:, None], ("r",),
                 np.array(correct, float))


def test_xrpo_seeding_pool_and_exemplars_by_hand():
    from adarl.hints.xrpo import overlap, seeded

    seeding = registry.build("hints", {"name": "xrpo", "k": 2, "pool": 3})
    # Jaccard by hand: {what, is, 2, plus, 3} vs {what, is, 7, plus, 8}: 3 shared of 7 words
    assert overlap("What is 2 plus 3?", "what is 7 plus 8") == pytest.approx(3 / 7)
    groups = [solved_group("a", "What is 2 plus 3?", ["It is 5, since 2+3=5.", "5"], [1, 1]),
              solved_group("b", "Name a colour.", ["red"], [1]),
              solved_group("c", "What is 4 plus 4?", ["8", "9"], [0, 0]),  # failed: not an exemplar
              solved_group("d", "What is 9 times 9?", ["81"], [1])]
    plans = seeding.plan(groups, 0)
    assert list(seeding.exemplars) == ["a", "b", "d"]  # the shortest correct answer of each solved group
    assert seeding.exemplars["a"] == ("What is 2 plus 3?", "5")
    # c's exemplars: a (3 shared of {what,is,2,plus,3,4}: 3/6 = .5) and d ({what,is,4,plus,9,times}: 2/6)
    (plan,) = plans
    assert plan.problem.id == "c" and plan.n == 2 and plan.replace and plan.placement == "exemplars"
    assert [m["content"] for m in plan.messages] == ["What is 2 plus 3?", "5", "What is 9 times 9?", "81",
                                                     "What is 4 plus 4?"]
    assert [m["role"] for m in plan.messages] == ["user", "assistant", "user", "assistant", "user"]
    # a newer solution replaces the old one and counts as recent; the pool keeps the 3 most recent problems
    seeding.plan([solved_group("e", "Spell cat.", ["c-a-t"], [1]), solved_group("b", "Name a colour.", ["blue"], [1])],
                 0)
    assert list(seeding.exemplars) == ["d", "e", "b"] and seeding.exemplars["b"][1] == "blue"
    # never the prompt itself; ties go to the most recent; the system message stays first
    sys_group = solved_group("d", "What is 9 times 9?", ["1"], [0], system="Be brief.")
    assert [q for q, _ in seeding.shots(sys_group.problem)] == ["Name a colour.", "Spell cat."]  # b is newest
    assert [m["role"] for m in seeded(sys_group.problem, [("q", "a")])] == ["system", "user", "assistant", "user"]
    fresh = registry.build("hints", {"name": "xrpo", "k": 2, "pool": 3})
    fresh.load_state_dict(seeding.state_dict())
    assert fresh.exemplars == seeding.exemplars


def test_xrpo_seeded_rollouts_replace_the_failed_group(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer"}], allocate={"name": "fixed", "n": 4},
                       hints={"name": "xrpo", "k": 1}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    trainer.hints.load_state_dict({"exemplars": [["old", "Compute 5", "SEEDED-ANSWER"]]})  # solved earlier
    asked = []
    complete = trainer.rollouts.complete

    def spy(requests, max_tokens=None):
        asked.extend(requests)
        return complete(requests, max_tokens)

    monkeypatch.setattr(trainer.rollouts, "complete", spy)
    row = trainer.train_step()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert row["hints/groups"] == 2 and row["hints/xrpo/seeded_groups"] == 2
    assert len(rollouts) == 8 and all(r.guided for r in rollouts)  # trained as if from the bare prompt
    seeded = [trainer.tokenizer.decode(r.prompt_ids) for r in asked if "SEEDED-ANSWER" in
              trainer.tokenizer.decode(r.prompt_ids)]
    assert len(seeded) == 2 and all("Compute 5" in s for s in seeded)
    assert all(g.prompt_ids == trainer.prompt_ids(g.problem) for g in trainer.last_groups)  # bare context


def test_hint_rounds_are_timed_with_the_step_s_generation(tiny_model_dir, tmp_path, monkeypatch):
    """A hint round generates through the trainer's own path: its time is in `generate_s`, so
    `tokens_per_s` (the step's tokens, hinted ones included, over `generate_s`) is not overstated."""
    import time

    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer"}], allocate={"name": "fixed", "n": 2},
                       hints={"name": "guide", "source": "solution"}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    complete = trainer.rollouts.complete

    def slow_complete(requests, *args, **kwargs):
        if "Hint:" in trainer.tokenizer.decode(requests[0].prompt_ids):  # Guide's hint round
            time.sleep(1.5)
        return complete(requests, *args, **kwargs)

    monkeypatch.setattr(trainer.rollouts, "complete", slow_complete)
    row = trainer.train_step()
    assert row["hints/rounds"] == 1
    assert row["generate_s"] >= 1.5  # the hint round's generation is counted once, here
    assert row["tokens_per_s"] == pytest.approx(row["step_tokens"] / row["generate_s"])


def test_a_hinted_agent_rollout_keeps_the_agent_s_tools(tiny_model_dir, tmp_path, monkeypatch):
    """Guide's hint goes into the agent's chat, whose system message describes its tools: the hinted
    rollout runs in the same environment with the same tools as the plain ones."""
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer"}], allocate={"name": "fixed", "n": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "agent": {"max_turns": 1}},
                       hints={"name": "guide", "source": "solution"}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    seen = []
    complete = trainer.rollouts.complete

    def record(requests, *args, **kwargs):
        seen.extend(text for r in requests if "Hint:" in (text := trainer.tokenizer.decode(r.prompt_ids)))
        return complete(requests, *args, **kwargs)

    monkeypatch.setattr(trainer.rollouts, "complete", record)
    trainer.train_step()
    assert len(seen) == 2  # both all-failed groups were hinted
    for text in seen:
        assert "Hint: It is 900" in text and "calculate" in text  # the hint, and the tools described

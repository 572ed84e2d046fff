"""Distillation auxiliaries and the teacher that scores the policy's tokens under another context.
Values are worked out by hand; the learner's gradient is compared with the formula written out
with autograd, independently of the learner."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adarl.config import DistillConfig
from adarl.loss.distill import distill_terms
from adarl.train.teacher import Teacher, privileged_messages
from adarl.types import Batch, Group, Problem, Rollout
from test_rollout_record import learner_gradient, tiny_model


def test_terms_by_hand():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0]])  # gaps g = +0.5 (endorsed), −1.0 (rejected)
    loss, stats = distill_terms("sdar", logp, teacher, gate_temperature=1.0)
    gate = torch.sigmoid(torch.tensor([0.5, -1.0]))
    assert torch.allclose(loss, gate * torch.tensor([1.0, 2.0]))  # −σ(g)·ℓ
    loss.sum().backward()
    assert torch.allclose(logp.grad, -gate[None])  # pulled up, the rejected token less (σ(−1) ≈ .27), never down
    logp.grad = None
    loss, _ = distill_terms("opd", logp, teacher)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 1.0]]))  # −g: the rejected token is pushed down
    # top-k: the student gives the teacher's two tokens .5 and .25, the teacher .25 and .25
    s_top, t_top = torch.log(torch.tensor([[[0.5, 0.25]]])), torch.log(torch.tensor([[[0.25, 0.25]]]))
    one = torch.tensor([[-1.0]])
    reverse, _ = distill_terms("opd", one, one, estimator="topk", student_top=s_top, teacher_top=t_top)
    assert reverse.item() == pytest.approx(0.5 * math.log(2))  # .5·ln(.5/.25) + .25·ln(.25/.25)
    forward, _ = distill_terms("opd", one, one, estimator="topk", direction="forward", student_top=s_top,
                               teacher_top=t_top)
    assert forward.item() == pytest.approx(0.5 * math.log(0.5 / 0.5) + 0.5 * math.log(0.5 / 0.25))
    # AOPD: g > 0 keeps −g·ℓ; g ≤ 0 is KL(π_T ‖ π_θ) over the top-k instead (weight 2)
    loss, stats = distill_terms("aopd", torch.tensor([[-1.0, -2.0]]), teacher, div_weight=2.0,
                                student_top=s_top.expand(1, 2, 2), teacher_top=t_top.expand(1, 2, 2))
    assert loss[0, 0].item() == pytest.approx(0.5) and loss[0, 1].item() == pytest.approx(2 * 0.5 * math.log(2))
    assert stats["distill/positive_fraction"].tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="top-k"):
        distill_terms("aopd", logp, teacher)


def test_the_teacher_sees_the_privileged_context():
    p = Problem("p", "What is 2 + 3?", answer="5", columns={"hint": "add the units"})
    assert privileged_messages(p, "answer")[-1]["content"] == "What is 2 + 3?\n\nThe correct final answer is: 5"
    assert privileged_messages(p, "hint")[-1]["content"].endswith("Hint: add the units")
    assert privileged_messages(p, "solution") == p.messages  # no solution column: asked plainly
    assert privileged_messages(p, "none") == p.messages
    assert DistillConfig(method="aopd").top_k == 32 and DistillConfig().top_k is None


@pytest.mark.model
@pytest.mark.parametrize("method", ["sdar", "opd"])
def test_the_learner_applies_the_distillation_gradient(method):
    model = tiny_model()
    prompt, privileged = [1, 2, 3], [4, 5, 1, 2, 3]
    rollouts = [Rollout("p", [6, 7, 8], [-1.0] * 3, "stop"), Rollout("p", [9, 10], [-1.0] * 2, "stop")]
    g = Group(Problem("p", "q", "1"), prompt, rollouts, np.ones((2, 1)), ("r",), np.ones(2))
    batch = Batch([g], advantages=np.zeros(2))  # equal rewards: the RL term is 0, distillation alone moves it
    cfg = DistillConfig(method=method, weight=1.0, rl_weight=0.0)
    teacher = Teacher(cfg, model, tokenizer=None)
    teacher.prompt_ids = lambda problem: privileged  # the teacher's context: 2 privileged tokens first
    # by hand: token-mean over the 5 sampled tokens of −w·ℓ_θ, w = σ(g) (sdar) or g (opd), g = ℓ_T − ℓ_θ detached
    model.zero_grad()
    total = torch.zeros(())
    for r in rollouts:
        logp = torch.log_softmax(model(torch.tensor([prompt + r.completion_ids])).logits[0].float(), -1)
        with torch.no_grad():
            t_logp = torch.log_softmax(model(torch.tensor([privileged + r.completion_ids])).logits[0].float(), -1)
        for t, tok in enumerate(r.completion_ids):
            lp, lt = logp[len(prompt) - 1 + t, tok], t_logp[len(privileged) - 1 + t, tok]
            gap = (lt - lp).detach()
            total = total - (torch.sigmoid(gap) if method == "sdar" else gap) * lp / 5
    total.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, row = learner_gradient(model, batch, teacher=teacher)
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=1e-6), name
    assert row["distill/teacher_forward_tokens"] == 5 + 3 + 5 + 2


@pytest.mark.parametrize("distill", [{"method": "aopd", "teacher": "ema", "context": "answer"},
                                     {"method": "sdar", "teacher": "snapshot", "length_guard": 1.5},
                                     {"method": "opd", "teacher": "MODEL", "context": "none", "estimator": "topk"}])
def test_distillation_trains_end_to_end_and_resumes(distill, tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    if distill["teacher"] == "MODEL":  # another model: a local HF folder (here the policy's own weights)
        distill = {**distill, "teacher": str(tiny_model_dir)}
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8}, distill=distill,
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.learner.teacher.model.named_parameters()}
    row = trainer.train_step()
    assert row["distill/teacher_forward_tokens"] > 0 and "distill/gap" in row
    moved = any(not torch.equal(before[n], p) for n, p in trainer.learner.teacher.model.named_parameters())
    assert moved == (distill["teacher"] == "ema")  # the EMA teacher follows the policy; a snapshot stays
    if distill["method"] == "opd":  # a separate teacher starts as the policy: the gap is 0 before any update
        assert abs(row["distill/gap"]) < 1e-5
    state = trainer.learner.state_dict()
    fresh = Trainer(load_recipe(data=data), tmp_path / "run2")
    fresh.learner.load_state_dict(state)
    for a, b in zip(fresh.learner.teacher.model.parameters(), trainer.learner.teacher.model.parameters(), strict=True):
        assert torch.equal(a, b)

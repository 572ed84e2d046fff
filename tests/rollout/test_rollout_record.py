"""The rollout record: spans with a sampled-token mask, shared spans trained once.

Expected values are derived by hand (masks, counts, mean advantages) or computed independently
of the learner (the policy gradient written out with autograd over the sampled positions).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adarl import registry
from adarl.budget import Budget
from adarl.config import TrainConfig
from adarl.rollout.scheduler import _Group, _groups_from, _groups_state
from adarl.tokens.base import weigh_tokens
from adarl.tokens.entropy import EntropyObserver, EntropyStats
from adarl.train.learner import Learner, token_advantages
from adarl.types import Batch, Group, Problem, Request, Rollout, Span, trainable_masks


def tool_rollout() -> Rollout:
    """model [5, 6] → tool [9, 9, 9] → model [7]: three sampled tokens, three of context."""
    return Rollout("p", finish_reason="stop", spans=[
        Span("model", [5, 6], [-0.5, -0.25], [1.0, 2.0], [0, 0]),
        Span("tool", [9, 9, 9], name="calc", status="ok"),
        Span("model", [7], [-1.0], [3.0], [1]),
    ])


def test_one_span_rollout_is_the_flat_record():
    r = Rollout("p", [1, 2, 3], [-0.1, -0.2, -0.3], "length", entropies=[0.5, 0.6, 0.7], token_versions=[4, 4, 5])
    assert r.completion_ids == [1, 2, 3] and r.logprobs == [-0.1, -0.2, -0.3] and len(r) == 3
    assert r.entropies == [0.5, 0.6, 0.7] and r.token_versions == [4, 4, 5]
    assert r.sampled_mask.tolist() == [1.0, 1.0, 1.0] and r.finish_reason == "length"
    with pytest.raises(ValueError, match="log-probs"):
        Rollout("p", [1, 2], [-0.1], "stop")


def test_tool_tokens_are_context_not_sampled():
    r = tool_rollout()
    assert r.completion_ids == [5, 6, 9, 9, 9, 7]  # what the model reads
    assert len(r) == 3  # what it cost: sampled tokens only
    assert r.sampled_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert r.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert r.sampled_logprobs == [-0.5, -0.25, -1.0]
    assert r.entropies == [1.0, 2.0, 0.0, 0.0, 0.0, 3.0]
    assert r.token_versions == [0, 0, 1]  # of sampled tokens
    budget = Budget()
    budget.spend([r, r])
    assert budget.total_tokens == 6 and budget.total_rollouts == 2


def test_a_shared_prefix_is_trained_once_with_the_mean_advantage():
    prefix = Span("model", [1, 2], [-0.1, -0.1])
    a = Rollout("p", finish_reason="stop", spans=[prefix, Span("model", [3], [-0.1])])
    b = Rollout("p", finish_reason="stop", spans=[prefix, Span("model", [4, 5], [-0.1, -0.1])])
    c = Rollout("p", [6], [-0.1], "stop")
    masks = trainable_masks([a, b, c])
    assert [m.tolist() for m in masks] == [[1, 1, 1], [0, 0, 1, 1], [1]]
    adv = token_advantages([a, b, c], np.array([1.0, -3.0, 2.0]), masks)
    # the prefix: (1 + −3) / 2 = −1, in a only; b's copy is masked
    assert [x.tolist() for x in adv] == [[-1.0, -1.0, 1.0], [0.0, 0.0, -3.0, -3.0], [2.0]]


def test_token_weights_start_from_the_trainable_tokens():
    r = tool_rollout()
    g = Group(Problem("p", "q"), [1], [r, Rollout("p", [5], [-0.2], "stop")])
    weights, _ = weigh_tokens([], Batch([g]), 0.0)
    assert [w.tolist() for w in weights] == [[1, 1, 0, 0, 0, 1], [1]]


def test_entropy_statistics_see_sampled_tokens_only():
    r = tool_rollout()
    observer = EntropyObserver(pivot=0.8)
    observer.observe([np.asarray(r.entropies)], [r.sampled_mask])
    assert observer.stats == EntropyStats.fit(np.array([1.0, 2.0, 3.0]), 0.8)


def test_scheduler_state_keeps_spans_and_their_sharing():
    prefix = Span("model", [1, 2], [-0.1, -0.2], None, [0, 0])
    rollouts = [Rollout("p", finish_reason="partial", spans=[prefix, Span("model", [3], [-0.3], None, [1])]),
                Rollout("p", finish_reason="stop",
                        spans=[prefix, Span("tool", [8]), Span("model", [4], [-0.4], None, [1])])]
    back = _groups_from(_groups_state([_Group(0, Request("p", [1], 2), [11, 12], rollouts)]))[0].rollouts
    assert [r.completion_ids for r in back] == [[1, 2, 3], [1, 2, 8, 4]]
    assert back[1].sampled_mask.tolist() == [1, 1, 0, 1] and back[0].token_versions == [0, 0, 1]
    assert back[0].spans[0] is back[1].spans[0]  # still one shared span


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def applied_gradient(model, batch: Batch, **learner_kw) -> dict[str, torch.Tensor]:
    """The gradient the learner applies in its update of `batch` (on-policy PPO, token-mean)."""
    return learner_gradient(model, batch, **learner_kw)[0]


def learner_gradient(model, batch: Batch, **learner_kw) -> tuple[dict[str, torch.Tensor], dict]:
    """(the gradient the learner applies, its update's metrics)."""
    loss = registry.build("loss", {"name": "ppo_clip", "agg": "token-mean"})
    learner = Learner(model, loss, TrainConfig(lr=1e-3, max_grad_norm=None), temperature=1.0, pad_id=0,
                      max_len=16, rng=np.random.default_rng(0), **learner_kw)
    grads = {}

    def capture(self):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return Learner.optim_step(self)

    learner.optim_step = capture.__get__(learner)
    row = learner.update(batch)
    return grads, row


def reference_gradient(model, prompt: list[int], rollouts: list[Rollout], token_adv: list[list[float]],
                       trained: list[list[int]]) -> dict[str, torch.Tensor]:
    """−Σ A_{i,t} ∇log π(y_t) / N over the trained positions (on-policy PPO, token-mean), by hand."""
    model.zero_grad()
    n = sum(sum(t) for t in trained)
    total = torch.zeros(())
    for r, adv, mask in zip(rollouts, token_adv, trained, strict=True):
        ids = torch.tensor([prompt + r.completion_ids])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        for t, tok in enumerate(r.completion_ids):
            if mask[t]:
                total = total - adv[t] * logp[len(prompt) - 1 + t, tok] / n
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.model
def test_the_update_trains_sampled_tokens_and_a_shared_prefix_once():
    model = tiny_model()
    prompt = [1, 2, 3]
    prefix = Span("model", [4, 5], [-1.0, -1.0])
    a = Rollout("p", finish_reason="stop", spans=[prefix, Span("tool", [9, 9]), Span("model", [6], [-1.0])])
    b = Rollout("p", finish_reason="stop", spans=[prefix, Span("model", [7, 8], [-1.0, -1.0])])
    c = Rollout("p", [10, 11], [-1.0, -1.0], "stop")
    batch = Batch([Group(Problem("p", "q"), prompt, [a, b, c])])
    batch.advantages = np.array([1.0, -0.5, 2.0])
    # by hand: the prefix trains once (in a) with (1 − 0.5)/2 = 0.25; a's tool tokens never; N = 7
    expected = reference_gradient(model, prompt, [a, b, c],
                                  [[0.25, 0.25, 0, 0, 1.0], [0, 0, -0.5, -0.5], [2.0, 2.0]],
                                  [[1, 1, 0, 0, 1], [0, 0, 1, 1], [1, 1]])
    got = applied_gradient(model, batch)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


def test_a_token_budgeted_run_gives_token_weightings_its_progress(tiny_model_dir, tmp_path, monkeypatch):
    """`Trainer.progress` by tokens: it read a budget attribute that does not exist, so any token
    weighting in a run bounded by budget.max_tokens crashed at its first update."""
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": None, "max_tokens": 200,
                                                                     "prompts_per_step": 2},
                       tokens=[{"name": "high_entropy", "top": 0.5}], log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    seen = []
    weighting = trainer.token_weightings[0]
    trainer.token_weightings[0] = lambda batch, w, progress: seen.append(progress) or weighting(batch, w, progress)
    spent = []
    for _ in range(2):
        trainer.train_step()
        spent.append(trainer.budget.total_tokens)
    # each update sees the tokens generated so far, this step's included, over the 200 allowed
    assert seen == pytest.approx([min(1.0, s / 200) for s in spent]) and 0.0 < seen[0] < seen[1]


def test_xrpo_novelty_reads_sampled_log_probs_only():
    from adarl.advantage.xrpo import mean_logprob

    g = Group(Problem("p", "q"), [1], [tool_rollout(), Rollout("p", [5], [-0.2], "stop")])
    s, defined = mean_logprob(Batch([g]))
    # by hand: (−0.5 − 0.25 − 1.0) / 3 over the three sampled tokens, not / 6 with the tool's zeros
    assert s.tolist() == pytest.approx([-1.75 / 3, -0.2]) and defined.tolist() == [True, True]

"""Train–inference mismatch correction (loss/mismatch.py, algorithms.md §3.6): weights, masks, masked
fractions and losses worked by hand; the learner applying it; its default per engine; its recipe keys.

Every example takes ℓ_old = 0 and ℓ_beh = −log w, so each token's ratio w = exp(ℓ_old − ℓ_beh) is the
number written down. Two sequences of three tokens:

    A  w = [2, 0.5, 4]          W_A = 2·0.5·4 = 4            Ŵ_A = 4^{1/3} = 1.5874011
    B  w = [1.5, 1.2, (100)]    the third token is not trained (mask 0), so it enters neither statistic:
                                W_B = 1.5·1.2 = 1.8          Ŵ_B = 1.8^{1/2} = 1.3416408

Five trained tokens, so a fraction of them is a multiple of 1/5.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adarl import registry
from adarl.config import MismatchConfig, RecipeError, TrainConfig, load_recipe
from adarl.loss.aggregate import aggregate
from adarl.loss.base import LossInputs
from adarl.loss.mismatch import correction, ratio_quantiles
from adarl.train.build import corrects_mismatch
from adarl.train.learner import Learner
from adarl.types import Batch, Group, Problem, Rollout

W = [[2.0, 0.5, 4.0], [1.5, 1.2, 100.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
OLD = torch.zeros(2, 3, dtype=torch.float64)
BEH = -torch.log(torch.tensor(W, dtype=torch.float64))


@pytest.mark.parametrize(("mode", "band", "omega", "masked", "truncated"), [
    # clamp(w, 0, 3): A's 4 → 3 (one token of five truncated)
    ("token_truncate", (0.0, 3.0), [[2.0, 0.5, 3.0], [1.5, 1.2]], 0.0, 1 / 5),
    # w·1[0.6 ≤ w ≤ 3]: A's 0.5 and 4 dropped (two of five masked)
    ("token_mask", (0.6, 3.0), [[2.0, 0.0, 0.0], [1.5, 1.2]], 2 / 5, 0.0),
    # IcePop's band [0.5, 5] keeps every ratio here, 0.5 included (the band is closed)
    ("token_mask", (0.5, 5.0), [[2.0, 0.5, 4.0], [1.5, 1.2]], 0.0, 0.0),
    # clamp(W, 0, 3): W_A = 4 → 3 on A's three tokens; W_B = 1.8 on B's two
    ("sequence_truncate", (0.0, 3.0), [[3.0, 3.0, 3.0], [1.8, 1.8]], 0.0, 3 / 5),
    # W·1[0 ≤ W ≤ 3] (TRL's default): A (W = 4) dropped whole, three tokens of five
    ("sequence_mask", (0.0, 3.0), [[0.0, 0.0, 0.0], [1.8, 1.8]], 3 / 5, 0.0),
    # 1[1 ≤ Ŵ ≤ 1.5]: Ŵ_A = 1.587 out, Ŵ_B = 1.342 in, with weight 1 (the mask alone)
    ("geometric_mask", (1.0, 1.5), [[0.0, 0.0, 0.0], [1.0, 1.0]], 3 / 5, 0.0),
])
def test_weights_and_fractions_worked_by_hand(mode, band, omega, masked, truncated) -> None:
    weight, stats = correction(OLD, BEH, MASK, mode, *band)
    got = [weight[0].tolist(), weight[1, :2].tolist()]
    assert got[0] == pytest.approx(omega[0], rel=1e-12) and got[1] == pytest.approx(omega[1], rel=1e-12)
    mean = {key: float((value * MASK).sum() / MASK.sum()) for key, value in stats.items()}  # as the learner sums
    assert mean["mismatch/masked_fraction"] == pytest.approx(masked)
    assert mean["mismatch/truncated_fraction"] == pytest.approx(truncated)
    assert mean["mismatch/weight_mean"] == pytest.approx(sum(omega[0] + omega[1]) / 5)


def test_a_long_sequence_cannot_overflow_the_product() -> None:
    """Σ log w = 400 · log 10 ≈ 921: W = inf, dropped (mask) or cut to 3 (truncate), never inf · 0 = NaN."""
    beh = torch.full((1, 400), -math.log(10.0), dtype=torch.float64)
    old, mask = torch.zeros_like(beh), torch.ones_like(beh)
    weight, stats = correction(old, beh, mask, "sequence_mask", 0.0, 3.0)
    assert torch.equal(weight, torch.zeros_like(weight)) and bool(stats["mismatch/masked_fraction"].all())
    weight, _ = correction(old, beh, mask, "sequence_truncate", 0.0, 3.0)
    assert torch.equal(weight, torch.full_like(weight, 3.0))


def test_the_weight_multiplies_the_clipped_term_and_not_the_kl() -> None:
    """ppo_clip (ε = 0.2, A = 1, ℓ_old = 0) with log ρ = [0.1, 0.3] and w = [2, 4], token_truncate [0, 3]:

        ω = [2, 3]
        clipped term  −min(ρA, clip(ρ)A) = [−e^{0.1}, −1.2]          (ρ_1 = e^{0.3} = 1.35 > 1.2: clipped)
        KL (k1, β = 0.1, ℓ_ref = 0)      = 0.1 · [0.1, 0.3] = [0.01, 0.03]
        L = ω · clipped + KL             = [−2e^{0.1} + 0.01, −3.6 + 0.03] = [−2.2003418, −3.57]
        dL/dℓ_θ                          = [−2e^{0.1} + 0.1, 0 + 0.1]      = [−2.1103418, 0.1]
    The PPO clip acts on ρ = π_θ/π_old alone: ω = 3 does not un-clip token 1 (its gradient is the KL's).
    """
    logp = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    beh = -torch.log(torch.tensor([[2.0, 4.0]], dtype=torch.float64))
    x = LossInputs(logp=logp, old_logp=old, adv=torch.ones(1, 2, dtype=torch.float64), mask=mask,
                   ref_logp=torch.zeros(1, 2, dtype=torch.float64))
    x.correction, _ = correction(old, beh, mask, "token_truncate", 0.0, 3.0)
    loss_fn = registry.build("loss", {"name": "ppo_clip", "kl_coef": 0.1, "kl": "k1"})
    loss, _ = loss_fn(x)
    loss.sum().backward()
    assert loss.detach()[0].tolist() == pytest.approx([-2 * math.exp(0.1) + 0.01, -3.6 + 0.03], abs=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([-2 * math.exp(0.1) + 0.1, 0.1], abs=1e-6)


def test_masked_tokens_stay_in_the_denominator() -> None:
    """sequence_mask drops A (3 tokens); token-mean still divides by 5: on-policy ρ = 1, A = 1 everywhere,
    so L = −ω and the mean is (0 + 0 + 0 − 1.8 − 1.8) / 5 = −0.72 (not −1.8, the mean over B alone)."""
    logp = OLD.clone().requires_grad_(True)
    x = LossInputs(logp=logp, old_logp=OLD, adv=torch.ones(2, 3, dtype=torch.float64), mask=MASK)
    x.correction, _ = correction(OLD, BEH, MASK, "sequence_mask", 0.0, 3.0)
    loss, _ = registry.build("loss", {"name": "ppo_clip"})(x)
    assert aggregate(loss, MASK, "token-mean").item() == pytest.approx(-0.72)


def test_ratio_quantiles_worked_by_hand() -> None:
    """w = [0.5, 1, 2, 4] (numpy's linear quantiles: position q·(n − 1) = 3q):
    1%: 0.5 + 0.03·0.5 = 0.515; median: (1 + 2)/2 = 1.5; 99%: 2 + 0.97·2 = 3.94."""
    got = ratio_quantiles(np.log([2.0, 0.5, 4.0, 1.0]))
    assert got == pytest.approx({"mismatch/ratio_min": 0.5, "mismatch/ratio_p01": 0.515, "mismatch/ratio_p50": 1.5,
                                 "mismatch/ratio_p99": 3.94, "mismatch/ratio_max": 4.0})
    assert ratio_quantiles(np.zeros(0)) == {}


# ---------------------------------------------------------------- the learner applies it


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log π(y_t | ·) of each completion token, written out (temperature 1)."""
    logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(completion)])


def update(model, batch: Batch, mismatch: MismatchConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(the gradient the learner applies, the step's metrics): on-policy ppo_clip, token-mean."""
    learner = Learner(model, registry.build("loss", {"name": "ppo_clip"}),
                      TrainConfig(lr=1e-3, max_grad_norm=None, mismatch=mismatch), temperature=1.0, pad_id=0,
                      max_len=16, rng=np.random.default_rng(0))
    grads: dict[str, torch.Tensor] = {}

    def capture(self):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return Learner.optim_step(self)

    learner.optim_step = capture.__get__(learner)
    return grads, learner.update(batch)


@pytest.mark.model
def test_the_learner_weighs_each_sequence_and_reports_the_step() -> None:
    """Behaviour log-probs set to ℓ_old − log w: A's w = [2, 0.5, 4] (W = 4), B's [1.5, 1.2, 1] (W = 1.8).
    sequence_mask [0, 3] drops A and weighs B by 1.8, so with A_A = 1, A_B = −1 and six tokens the applied
    gradient is 1.8 · (+Σ_t ∇ℓ_θ(B_t)) / 6; masked fraction 3/6, mean ω (0·3 + 1.8·3)/6 = 0.9; the ratios
    [2, 0.5, 4, 1.5, 1.2, 1] have min 0.5, median (1.2 + 1.5)/2 = 1.35, max 4."""
    model = tiny_model()
    prompt, a_ids, b_ids = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    with torch.no_grad():
        old_a, old_b = token_logprobs(model, prompt, a_ids), token_logprobs(model, prompt, b_ids)
    beh_a = (old_a - torch.log(torch.tensor([2.0, 0.5, 4.0]))).tolist()
    beh_b = (old_b - torch.log(torch.tensor([1.5, 1.2, 1.0]))).tolist()

    def batch() -> Batch:
        b = Batch([Group(Problem("p", "q"), prompt, [Rollout("p", a_ids, beh_a, "stop"),
                                                       Rollout("p", b_ids, beh_b, "stop")])])
        b.advantages = np.array([1.0, -1.0])
        return b

    (1.8 * token_logprobs(model, prompt, b_ids).sum() / 6).backward()  # −A_B·ω·Σ∇ℓ / N, A_B = −1
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, row = update(copy.deepcopy(model), batch(), MismatchConfig(correct=True, mode="sequence_mask"))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7)
    assert row["mismatch/masked_fraction"] == pytest.approx(0.5)
    assert row["mismatch/weight_mean"] == pytest.approx(0.9, rel=1e-4)
    assert row["mismatch/ratio_min"] == pytest.approx(0.5, rel=1e-4)
    assert row["mismatch/ratio_p50"] == pytest.approx(1.35, rel=1e-4)
    assert row["mismatch/ratio_max"] == pytest.approx(4.0, rel=1e-4)

    # A trains too, with weight 1
    uncorrected, row = update(copy.deepcopy(model), batch(), MismatchConfig(correct=False))
    assert "mismatch/masked_fraction" not in row and row["mismatch/ratio_max"] == pytest.approx(4.0, rel=1e-4)
    assert any(not torch.allclose(uncorrected[n], got[n]) for n in got)


# ---------------------------------------------------------------- the default and the recipe keys


def recipe(*overrides: str):
    return load_recipe("quickstart", list(overrides))


@pytest.mark.parametrize(("overrides", "on"), [
    (["rollout.backend=hf"], False),  # the learner's own module samples: nothing to correct
    (["rollout.backend=vllm"], True),  # vLLM's kernels
    (["rollout.backend=hf", "cluster.backend=ray"], True),  # the hf decoder, but on a Ray worker's copy
    (["rollout.backend=my_engines.fast:Engine"], True),  # an engine of the user's, by import path
    (["rollout.backend=vllm", "loss.name=decoupled_ppo"], False),  # the loss weighs by π_old/π_beh already
    (["rollout.backend=vllm", "train.mismatch.correct=false"], False),  # the recipe's word stands
])
def test_on_by_default_where_the_sampler_is_not_the_learners_forward(overrides, on) -> None:
    r = recipe(*overrides)
    loss = registry.build("loss", r.loss)
    assert r.train.mismatch.correct in (None, False)
    resolved = r.train.mismatch.correct if r.train.mismatch.correct is not None else corrects_mismatch(r, loss)
    assert resolved is on


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.mismatch.low=-0.5"], "'train.mismatch.low': Input should be greater than or equal to 0"),
    (["train.mismatch.high=-1"], "'train.mismatch.high': Input should be greater than 0"),
    (["train.mismatch.low=4"], "'train.mismatch': low 4.0 must be below high 3.0 (the sequence_mask band"),
    (["train.mismatch.mode=token_mask", "train.mismatch.low=2", "train.mismatch.high=1"],
     "'train.mismatch': low 2.0 must be below high 1.0"),
    (["train.mismatch.mode=icepop"], "'train.mismatch.mode': Input should be 'token_truncate'"),
    (["train.mismatch.correct=true", "loss.name=decoupled_ppo"],
     "'train.mismatch.correct': loss decoupled_ppo already weighs each token by π_old/π_beh"),
])
def test_a_bad_band_fails_at_load_in_one_line(overrides, message) -> None:
    with pytest.raises(RecipeError) as err:
        recipe(*overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_each_mode_fills_its_documented_band() -> None:
    bands = {mode: (recipe(f"train.mismatch.mode={mode}").train.mismatch.low,
                    recipe(f"train.mismatch.mode={mode}").train.mismatch.high)
             for mode in ("token_truncate", "sequence_truncate", "token_mask", "sequence_mask", "geometric_mask")}
    assert bands == {"token_truncate": (0.0, 3.0), "sequence_truncate": (0.0, 3.0), "token_mask": (0.5, 5.0),
                     "sequence_mask": (0.0, 3.0), "geometric_mask": (0.999, 1.001)}
    assert recipe("train.mismatch.high=2").train.mismatch.low == 0.0  # one end given, the other the mode's


def test_the_run_report_draws_the_mismatch_kl_and_the_masked_fraction(tmp_path) -> None:
    """A run that corrected gets both panels; one that did not (hf: its sampler is its learner) neither."""
    import json

    from adarl.report import render
    from test_compare import write_run

    def report(name: str, logged: dict[str, float]) -> str:
        run = write_run(tmp_path / name, {0: 0.2}, steps=3, tokens_per_step=100)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text("".join(json.dumps({**r, **(logged if r["step"] else {})}) + "\n"
                                                   for r in rows))
        return render(run)

    plain = report("hf", {"sampler_kl_k3": 1e-14})
    text = report("vllm", {"sampler_kl_k3": 4e-4, "mismatch/masked_fraction": 0.02, "mismatch/weight_mean": 0.98})
    titles = ("Sampler/learner mismatch KL vs generated tokens", "Mismatch correction: masked fraction")
    assert all(t in text for t in titles) and not any(t in plain for t in titles)
    assert text.count("data:image/png") == plain.count("data:image/png") + 2


def test_sharded_ranks_pool_their_ratios_before_the_quantiles(monkeypatch) -> None:
    """Two ranks hold [0.5, 1] and [2, 4] (as log w): the quantiles are of all four, so the max is 4, not rank
    0's 1 (collectives faked: every rank's list is what `all_gather_object` would return)."""
    from adarl.train import sharded

    rank0, rank1 = np.log([0.5, 1.0]), np.log([2.0, 4.0])

    def all_gather_object(out: list, mine: np.ndarray) -> None:
        out[:] = [mine, rank1]

    monkeypatch.setattr(sharded.dist, "all_gather_object", all_gather_object)
    learner = sharded.ShardedLearner.__new__(sharded.ShardedLearner)
    learner.world = 2
    got = ratio_quantiles(learner._gather(rank0))
    assert got["mismatch/ratio_max"] == pytest.approx(4.0) and got["mismatch/ratio_p50"] == pytest.approx(1.5)

"""HAPO adaptive temperature in the hf generator (algorithms.md §4.2a): T_t = T_0·(1 + τ·ĥ_t)."""

from __future__ import annotations

import pytest
import torch

from adarl.config import AdaptiveTemperature, ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.hf import HfGenerator
from adarl.tokens.entropy import EntropyStats
from adarl.types import Request, Rollout

T0 = 0.7
# log-entropy pivot far below / above any real entropy: ĥ clamps to +1 / −1 for every token
ALWAYS_HIGH = EntropyStats(median=-50.0, scale=1.0, pos_max=1.0, neg_max=1.0)
ALWAYS_LOW = EntropyStats(median=50.0, scale=1.0, pos_max=1.0, neg_max=1.0)


def prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def full_forward_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion), V) float32 logits predicting each completion token, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(completion) - 1].float()


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    torch.manual_seed(0)
    return load_model(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def ids(model_and_tokenizer):
    return prompts(model_and_tokenizer[1], ["What is 12+34?", "Hi"])


def requests(ids: list[list[int]]) -> list[Request]:
    return [Request("a", ids[0], 4), Request("b", ids[1], 3)]


def row_prompts(ids: list[list[int]]) -> list[list[int]]:
    return [ids[0]] * 4 + [ids[1]] * 3


def generator(model_and_tokenizer, tau: float | None, stats: EntropyStats | None = None, seed: int = 7,
              top_p: float = 1.0) -> HfGenerator:
    model, tok = model_and_tokenizer
    adaptive = AdaptiveTemperature(tau=tau) if tau is not None else None
    cfg = RolloutConfig(max_new_tokens=16, temperature=T0, top_p=top_p, adaptive_temperature=adaptive)
    gen = HfGenerator(model, tok, cfg, seed=seed)
    if stats is not None:
        gen.set_entropy_stats(stats)
    return gen


def token_logps(logits: torch.Tensor, tokens: list[int], temperature: torch.Tensor | float) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[:, None]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def same(a: list[Rollout], b: list[Rollout]) -> None:
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.entropies for r in a] == [r.entropies for r in b]


@pytest.mark.parametrize(("stats", "factor"), [(ALWAYS_HIGH, 1.5), (ALWAYS_LOW, 0.5)])
def test_clamped_h_samples_at_t0_times_one_plus_tau(model_and_tokenizer, ids, stats, factor):
    """ĥ = ±1 everywhere: behaviour log-probs are under T_0·(1 ± τ), entropies stay at T_0."""
    model, _ = model_and_tokenizer
    gen = generator(model_and_tokenizer, tau=0.5, stats=stats)
    rollouts = gen.generate(requests(ids))
    t = T0 * factor
    gap = 0.0
    for p, r in zip(row_prompts(ids), rollouts, strict=True):
        logits = full_forward_logits(model, p, r.completion_ids)
        recorded = torch.tensor(r.logprobs)
        torch.testing.assert_close(recorded, token_logps(logits, r.completion_ids, t), atol=1e-4, rtol=1e-4)
        logp_t0 = torch.log_softmax(logits / T0, -1)
        torch.testing.assert_close(torch.tensor(r.entropies), -(logp_t0.exp() * logp_t0).sum(-1), atol=1e-4, rtol=1e-4)
        gap = max(gap, (recorded - token_logps(logits, r.completion_ids, T0)).abs().max().item())
    assert gap > 1e-2  # the T_0 log-probs are different: the check above is not vacuous
    assert gen.last_temperature_mean == pytest.approx(t, abs=1e-6)


def test_per_token_temperature_from_fitted_stats(model_and_tokenizer, ids):
    """Stats fitted on a previous batch: each token is sampled at its own T_0·(1 + τ·ĥ(H_t))."""
    model, _ = model_and_tokenizer
    previous = generator(model_and_tokenizer, tau=0.5, seed=1).generate(requests(ids))
    stats = EntropyStats.fit(torch.tensor(sum((r.entropies for r in previous), [])).numpy(), pivot=0.8)
    gen = generator(model_and_tokenizer, tau=0.5, stats=stats, seed=2)
    rollouts = gen.generate(requests(ids))
    temps = []
    for p, r in zip(row_prompts(ids), rollouts, strict=True):
        logits = full_forward_logits(model, p, r.completion_ids)
        h = torch.log_softmax(logits / T0, -1)
        h_hat = stats.normalise(-(h.exp() * h).sum(-1))
        t = T0 * (1 + 0.5 * h_hat)
        temps.append(t)
        torch.testing.assert_close(torch.tensor(r.logprobs), token_logps(logits, r.completion_ids, t),
                                   atol=1e-4, rtol=1e-4)
    temps = torch.cat(temps)
    assert temps.min() < T0 - 1e-3 and temps.max() > T0 + 1e-3  # both directions occurred
    assert gen.last_temperature_mean == pytest.approx(temps.mean().item(), abs=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_tau_zero_reproduces_fixed_temperature_exactly(model_and_tokenizer, ids, top_p):
    fixed = generator(model_and_tokenizer, tau=None, top_p=top_p).generate(requests(ids))
    for stats in (ALWAYS_HIGH, ALWAYS_LOW):
        same(generator(model_and_tokenizer, tau=0.0, stats=stats, top_p=top_p).generate(requests(ids)), fixed)


def test_no_stats_means_fixed_temperature(model_and_tokenizer, ids):
    """The first training step has no previous statistics: it samples at T_0."""
    fixed_gen = generator(model_and_tokenizer, tau=None)
    fixed = fixed_gen.generate(requests(ids))
    gen = generator(model_and_tokenizer, tau=0.5)
    same(gen.generate(requests(ids)), fixed)
    assert gen.last_temperature_mean == fixed_gen.last_temperature_mean == pytest.approx(T0)
    # set, then cleared again
    gen2 = generator(model_and_tokenizer, tau=0.5, stats=ALWAYS_HIGH)
    gen2.set_entropy_stats(None)
    same(gen2.generate(requests(ids)), fixed)


def test_stats_ignored_without_adaptive_config_and_when_greedy(model_and_tokenizer, ids):
    fixed = generator(model_and_tokenizer, tau=None).generate(requests(ids))
    same(generator(model_and_tokenizer, tau=None, stats=ALWAYS_HIGH).generate(requests(ids)), fixed)
    greedy = [Request("a", ids[0], 1)]
    same(generator(model_and_tokenizer, tau=0.5, stats=ALWAYS_HIGH).generate(greedy, greedy=True),
         generator(model_and_tokenizer, tau=None).generate(greedy, greedy=True))


def test_state_dict_round_trip_keeps_stats(model_and_tokenizer, ids):
    stats = EntropyStats(median=0.25, scale=0.5, pos_max=2.0, neg_max=3.0)
    gen = generator(model_and_tokenizer, tau=0.5, stats=stats, seed=11)
    state = gen.state_dict()
    assert state["entropy_stats"] == {"median": 0.25, "scale": 0.5, "pos_max": 2.0, "neg_max": 3.0}
    assert all(type(v) is float for v in state["entropy_stats"].values())
    restored = generator(model_and_tokenizer, tau=0.5, seed=99)
    restored.load_state_dict(state)
    assert restored.entropy_stats == stats
    same(restored.generate(requests(ids)), gen.generate(requests(ids)))  # same rng and same temperatures
    # a state dict written before the stats existed loads, with no stats
    old = {k: v for k, v in generator(model_and_tokenizer, tau=0.5).state_dict().items() if k != "entropy_stats"}
    restored.load_state_dict(old)
    assert restored.entropy_stats is None
    assert generator(model_and_tokenizer, tau=0.5).state_dict()["entropy_stats"] is None

"""The smallest training run of the benchmarks' `--smoke` settings (tests/benchmarks/test_bench_smoke.py runs
them on the test suite's tiny random model): recipe overrides for a tiny batch on the hf backend, and a
reward a random model earns, so advantages, updates and pass rates are not all zero. Figures mean nothing."""

from __future__ import annotations

#: a completion holding a lowercase vowel scores 1. The tiny model's ~95 characters hold 5 of them, so
#: about a third of its random 8-token completions earn it ((90/95)^8 ≈ 0.65 do not): most groups are mixed
EARNED_REWARD = 'rewards=[{type: format, pattern: "[aeiou]", correctness: true}]'


def smoke_overrides(prompts: int = 2, n: int = 4, max_new_tokens: int = 8) -> list[str]:
    """`prompts` × `n` rollouts of up to `max_new_tokens` tokens a step, a 16-problem task, 4 held-out ones."""
    return ["rollout.backend=hf", f"budget.prompts_per_step={prompts}", f"allocate.n={n}",
            f"rollout.max_new_tokens={max_new_tokens}", "task.size=16", "task.eval_size=4", "eval.size=4",
            EARNED_REWARD]

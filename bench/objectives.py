"""The objective zoo at equal cost: what each advantage, shaping, token weighting and loss costs
per step, and what it buys in held-out pass@1 at an equal generated-token budget.

Overhead (`--overhead`): one quickstart step's rollouts (SmolLM2-135M, 8 prompts × 8, the hf
generator) are generated once; then every component in turn shapes, estimates, weights and
updates on that same batch (lr 0, so every repeat sees the same weights), interleaved over
`--repeats` rounds. Overhead = (component's median update − plain GRPO's) / plain GRPO's whole
step (generation + update). Generator-side components (HAPO adaptive temperature) are timed on
the generation of the same requests with the same seed. Run it on a quiet machine.

    .venv/bin/python bench/objectives.py --overhead [--repeats 3]

Quality (`--quality`): each objective trains the quickstart recipe to `--budget-tokens` generated
tokens over `--seeds`; reported are final held-out pass@1 (mean ± std), mean policy entropy over
training and mean clip fraction. Finished runs are kept under --runs (bench/equal_budget.py).

    .venv/bin/python bench/objectives.py --quality --objectives grpo,gspo,bapo --seeds 0,1,2

`--smoke --model TINY` is the smallest run of either part (2 prompts × 4 rollouts of up to 16 tokens, the
overlong shaping's buffer; a reward a random model earns; one round; quality: one seed
to 128 tokens): tests/benchmarks/test_bench_smoke.py runs it on a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from adarl import registry
from adarl.config import AdaptiveTemperature, load_recipe
from adarl.loss.base import LossInputs
from adarl.metrics.step import StepMetrics
from adarl.shaping.base import apply_shapings
from adarl.tokens.base import effective_tokens
from adarl.tokens.entropy import EntropyObserver, EntropyStats
from adarl.train.trainer import Trainer
from adarl.types import Batch, Group, Request
from equal_budget import budget_overrides, curve, train_run
from smoke import smoke_overrides

# name -> (recipe overrides for a quality run, the same as component specs for the overhead run)
OBJECTIVES: dict[str, dict] = {
    "grpo": {},
    "drgrpo": {"advantage": {"name": "drgrpo"}, "loss": {"name": "ppo_clip", "eps_high": 0.28,
                                                         "agg": "seq-mean-token-sum-norm"}},
    "rloo": {"advantage": {"name": "rloo"}},
    "reinforce_pp": {"advantage": {"name": "reinforce_pp"}},
    "xrpo_novelty": {"advantage": {"name": "xrpo"}},
    "rdpo": {"advantage": {"name": "rdpo"}},
    "hapo_adv": {"advantage": {"name": "hapo"}},
    "hbpo": {"advantage": {"name": "hbpo", "max_len": 64}, "shaping": [{"name": "hbpo", "max_len": 64}]},
    "overlong": {"shaping": [{"name": "overlong", "buffer": 16}]},
    "length_penalty": {"shaping": [{"name": "length_penalty"}]},
    "d3s": {"tokens": [{"name": "d3s"}]},
    "high_entropy": {"tokens": [{"name": "high_entropy"}]},
    "gspo": {"loss": {"name": "gspo"}},
    "bapo": {"loss": {"name": "bapo"}},
    "hapo_loss": {"loss": {"name": "hapo"}},
    "aepo": {"loss": {"name": "aepo"}},
    "dual_clip": {"loss": {"name": "ppo_clip", "eps_high": 0.28, "dual_clip": 3.0}},
    "entropy_bonus": {"loss": {"name": "ppo_clip", "eps_high": 0.28, "entropy_coef": 0.001}},
    "kl_k3": {"loss": {"name": "ppo_clip", "eps_high": 0.28, "kl_coef": 0.001, "kl": "k3"}},
    "hapo": {"advantage": {"name": "hapo"}, "loss": {"name": "hapo"},
             "rollout": {"adaptive_temperature": {"tau": 0.05}}},
}


def _overrides(spec: dict) -> list[str]:
    """A spec as dotted recipe overrides (values as YAML flow, which load_recipe parses)."""
    out = []
    for key, value in spec.items():
        if key == "rollout":
            out += [f"rollout.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            out.append(f"{key}={json.dumps(value)}")
    return out


# ------------------------------------------------------------------------------------- overhead


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def overhead(recipe_path: str, names: list[str], repeats: int, seed: int, micro_only: bool = False,
             extra: list[str] = (), rounds: int = 20) -> list[dict]:
    base = load_recipe(recipe_path, [f"seed={seed}", "train.lr=1e-30", "log.progress=false",
                                     "log.tensorboard=false", "checkpoint.every=0", *extra])
    trainer = Trainer(base, Path("runs/bench-objectives-overhead"))
    step_s = _timed(trainer.train_step)  # warm-up: allocations, first-touch pages
    print(f"warm-up step {step_s:.1f} s", flush=True)
    problems = [trainer.task.train[i] for i in range(base.budget.prompts_per_step)]
    requests = [Request(p.id, trainer.prompt_ids(p), 8) for p in problems]
    state = copy.deepcopy(trainer.generator.state_dict())

    def generate(adaptive: bool):
        trainer.generator.load_state_dict(copy.deepcopy(state))
        trainer.generator.cfg = base.rollout.model_copy(
            update={"adaptive_temperature": AdaptiveTemperature() if adaptive else None})
        return trainer.generator.generate(requests)

    rollouts = generate(False)
    by_prompt: dict[str, list] = {}
    for r in rollouts:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    verified = [Group(p, trainer.prompt_ids(p), by_prompt[p.id]) for p in problems]
    trainer.rewards.score(verified)
    trainer.generator.set_entropy_stats(None)
    costs = component_costs(trainer, verified, names, rounds)
    grpo = costs["grpo"]
    print("\n| component | own stages (ms) | own loss fwd+bwd (ms) | extra vs GRPO (ms) "
          "| tokens in the loss (A·w ≠ 0) |")
    print("|---|---|---|---|---|")
    for n, c in costs.items():
        extra = c["stage_ms"] + c["loss_ms"] - grpo["stage_ms"] - grpo["loss_ms"]
        print(f"| {n} | {c['stage_ms']:.2f} | {c['loss_ms']:.2f} | {extra:+.2f} | {c['trained_tokens']} |", flush=True)
    if micro_only:
        return [{"component": n, **c} for n, c in costs.items()]

    def update(name: str) -> float:
        spec = OBJECTIVES[name]
        groups = copy.deepcopy(verified)
        trainer.shapings = [registry.build("shaping", s) for s in spec.get("shaping", [])]
        trainer.estimator = registry.build("advantage", spec.get("advantage", base.advantage))
        trainer.token_weightings = [registry.build("tokens", s) for s in spec.get("tokens", [])]
        learner = trainer.learner
        learner.loss = registry.build("loss", spec.get("loss", base.loss))
        if learner.loss.kl_coef > 0 and learner.reference is None:
            learner.reference = copy.deepcopy(trainer.model).eval()
        learner.entropy = EntropyObserver() if learner.loss.needs_entropy else None
        t0 = time.perf_counter()
        apply_shapings(trainer.shapings, groups, base.rollout.max_new_tokens, StepMetrics())
        trainer.learn(Batch(groups), {})
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {n: [] for n in names}
    gen_times: dict[bool, list[float]] = {False: [], True: []}
    stats = EntropyStats.fit(np.concatenate([r.entropies for r in rollouts]))
    update(names[0])  # untimed: the first update after a generation ran ~40% slow in every round-1 reading
    for r in range(repeats):
        for n in names:
            times[n].append(update(n))
            print(f"  {n}: {times[n][-1]:.2f} s", flush=True)
        for adaptive in (False, True):
            trainer.generator.set_entropy_stats(stats if adaptive else None)
            gen_times[adaptive].append(_timed(lambda a=adaptive: generate(a)))
        print(f"round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)
    base_update = statistics.median(times["grpo"])
    base_gen = statistics.median(gen_times[False])
    step = base_update + base_gen
    rows = [{"component": n, "update_s": statistics.median(times[n]), **costs[n],
             "overhead": (statistics.median(times[n]) - base_update) / step} for n in names]
    rows.append({"component": "adaptive_temperature (generation)", "update_s": statistics.median(gen_times[True]),
                 "overhead": (statistics.median(gen_times[True]) - base_gen) / step})
    print(f"\nplain GRPO step: generation {base_gen:.2f} s + update {base_update:.2f} s = {step:.2f} s "
          f"(first full step, warm-up: {step_s:.2f} s); median of {repeats} rounds\n")
    print("| component | median time (s) | overhead vs GRPO step |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['component']} | {row['update_s']:.2f} | {100 * row['overhead']:+.1f}% |")
    return rows


def component_costs(trainer: Trainer, verified: list[Group], names: list[str], rounds: int = 20) -> dict[str, dict]:
    """Each component's own compute on the fixed batch, without the model passes it shares with GRPO:
    shaping + advantages + token weighting (numpy), and its loss forward + backward on the batch's
    per-token tensors. Also the tokens it sends to the model (trained rollouts' tokens)."""
    base = trainer.recipe
    rollouts = [r for g in verified for r in g.rollouts]
    width = max(len(r) for r in rollouts)
    shape = (len(rollouts), width)
    mask = torch.zeros(shape)
    for i, r in enumerate(rollouts):
        mask[i, : len(r)] = 1.0
    gen = torch.Generator().manual_seed(0)
    beh = -torch.rand(shape, generator=gen) * 3
    entropy = torch.rand(shape, generator=gen) * 2
    out = {}
    for name in names:
        spec = OBJECTIVES[name]
        shapings = [registry.build("shaping", s) for s in spec.get("shaping", [])]
        estimator = registry.build("advantage", spec.get("advantage", base.advantage))
        weightings = [registry.build("tokens", s) for s in spec.get("tokens", [])]
        loss_fn = registry.build("loss", {**spec.get("loss", base.loss), "kl_coef": 0.0, "entropy_coef": 0.0})
        t_stage = t_loss = 0.0
        for _ in range(rounds):
            groups = copy.deepcopy(verified)
            t0 = time.perf_counter()
            for shaping in shapings:
                shaping(groups, base.rollout.max_new_tokens)
            batch = Batch(groups)
            batch.advantages = estimator(batch)
            weights = [np.ones(len(r)) for r in batch.rollouts]
            for w in weightings:
                weights = w(batch, weights, 0.0)
            stats = EntropyStats.fit(np.concatenate([r.entropies for r in batch.rollouts]))
            t_stage += time.perf_counter() - t0
            logp = (beh + 0.01 * torch.randn(shape, generator=gen)).requires_grad_(True)
            adv = torch.tensor(batch.advantages, dtype=torch.float32)[:, None].expand(shape)
            x = LossInputs(logp=logp, old_logp=beh, adv=adv, mask=mask, entropy=entropy,
                           entropy_norm=stats.normalise(entropy), beh_logp=beh)
            t0 = time.perf_counter()
            loss, _ = loss_fn(x)
            (loss * mask).sum().backward()
            t_loss += time.perf_counter() - t0
        trained = effective_tokens(batch, weights)
        out[name] = {"stage_ms": 1000 * t_stage / rounds, "loss_ms": 1000 * t_loss / rounds, "trained_tokens": trained}
    return out


# -------------------------------------------------------------------------------------- quality


def quality(args: argparse.Namespace, names: list[str]) -> list[dict]:
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    for s in seeds:
        for n in names:
            run_dir = Path(args.runs) / f"b{args.budget_tokens}" / n / f"seed{s}"
            overrides = budget_overrides(s, args.budget_tokens, args.eval_every, args.eval_size, args.threads)
            overrides += args.extra
            kept = Path(args.results) / f"b{args.budget_tokens}" / n / f"seed{s}"
            results[n, s] = train_run(args.recipe, overrides + _overrides(OBJECTIVES[n]), run_dir, f"{n} seed {s}",
                                      args.report_only, kept)
    if any(v is None for v in results.values()):
        print("some runs are not finished (in another process, or --report-only)")
        return []
    print(f"\n{args.budget_tokens:,} generated tokens per run, seeds {seeds}\n")
    print("| objective | final pass@1 (mean ± std) | entropy (mean over steps) | clip fraction (mean) |")
    print("|---|---|---|---|")
    rows = []
    for n in names:
        finals = np.array([curve(results[n, s])[1][-1] for s in seeds])
        trained = [r for s in seeds for r in results[n, s] if "entropy" in r]
        entropy = float(np.mean([r["entropy"] for r in trained])) if trained else float("nan")
        clip = float(np.mean([r.get("clip_fraction", 0.0) for r in trained])) if trained else float("nan")
        rows.append({"objective": n, "final_mean": float(finals.mean()), "final_std": float(finals.std()),
                     "entropy": entropy, "clip_fraction": clip})
        print(f"| {n} | {finals.mean():.3f} ± {finals.std():.3f} | {entropy:.3f} | {clip:.4f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--micro-only", action="store_true", help="overhead: only the components' own compute")
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget-tokens", type=int, default=10000)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", default="runs/bench-objectives")
    parser.add_argument("--results", default="bench/results/objectives", help="finished runs' metrics (in git)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 prompts × 4 rollouts of 16 tokens, "
                        "1 round; quality: seed 0 to 128 tokens (with a tiny --model, for tests; figures mean nothing)")
    args = parser.parse_args()
    args.extra = [f"model.path={args.model}"] if args.model else []
    if args.smoke:  # 16 tokens: the overlong shaping's buffer
        args.extra += smoke_overrides(max_new_tokens=16)
        args.repeats, args.seeds, args.budget_tokens, args.eval_every, args.eval_size = 1, "0", 128, 0, 4
    names = args.objectives.split(",")
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown or not (args.overhead or args.quality):
        parser.error(f"choose --overhead and/or --quality; unknown objectives {unknown}; "
                     f"known: {', '.join(OBJECTIVES)}")
    torch.manual_seed(0)
    report = {}
    if args.overhead:
        report["overhead"] = overhead(args.recipe, ["grpo", *[n for n in names if n != "grpo"]], args.repeats, 0,
                                      args.micro_only, args.extra, rounds=2 if args.smoke else 20)
    if args.quality:
        report["quality"] = quality(args, names)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Tool use on 3-4-digit products (recipes/agent_calculator.yaml): held-out greedy pass@1 of the base
model with tools, after SFT cold start, after SFT + RL, and after single-turn RL without tools at
the same number of sampled tokens; and the agent loop's sampled-token throughput against plain
generation on the same model and prompts.

    .venv/bin/python bench/agent.py --seeds 0,1,2 --sft-steps 60 --budget-tokens 30000 --eval-size 200
    .venv/bin/python bench/agent.py --conditions sft,sft_rl --sft-steps 4 \
        --results bench/results/agent/cold4 --runs runs/bench-agent-cold4

The second is the light cold start: 4 SFT steps teach the call format to about a fifth of the
problems (60 steps saturate the task, leaving RL nothing to add); the base and no-tool conditions do
not depend on the SFT steps and are shared.

Each finished run's metrics are kept under bench/results/agent/<condition>/seed<k>/ (commit them as
they finish); a kept run is not redone. Target (issue 15): SFT + RL at least 20 points above both SFT
alone and no-tool RL; the loop at least 0.8x plain generation's sampled tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from adarl.config import load_recipe
from adarl.evaluate import EvalTask, evaluate_task
from adarl.models import chat_ids, load_model
from adarl.rollout import build_generator
from adarl.tasks import build_task
from adarl.train.sft import run_sft
from adarl.train.trainer import Trainer
from adarl.types import Request

RECIPE = "recipes/agent_calculator.yaml"


def held_out(recipe, model_path: str | None, eval_size: int, threads: int) -> float:
    """Greedy pass@1 on the held-out problems, with the recipe's rollout (the agent loop if it has one)."""
    if model_path:
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": model_path})})
    recipe.model.threads = threads
    model, tok = load_model(recipe.model, for_training=False)
    generator = build_generator(model, tok, recipe.rollout.model_copy(update={"backend": "hf"}))
    try:
        task = EvalTask("products", recipe.task, list(recipe.rewards), recipe.task.data_seed)
        summary, _ = evaluate_task(generator, tok, task, ks=[1], n=0, size=eval_size)
    finally:
        generator.close()
    return float(summary["greedy_pass@1"])


def kept(out: Path) -> dict | None:
    return json.loads(out.read_text()) if out.exists() else None


def run_condition(name: str, seed: int, args: argparse.Namespace) -> dict:
    out = Path(args.results) / name / f"seed{seed}" / "result.json"
    if (done := kept(out)) is not None:
        return done
    base = load_recipe(RECIPE, [f"seed={seed}", f"model.threads={args.threads}", "log.progress=false",
                                "log.tensorboard=false", "checkpoint.every=0"])
    runs = Path(args.runs) / f"seed{seed}"
    sft_dir = runs / "sft"
    t0 = time.perf_counter()
    if name == "base_tools":
        result = {"pass@1": held_out(base, None, args.eval_size, args.threads)}
    elif name == "sft":
        if not (sft_dir / "final").exists():
            run_sft(base, sft_dir, "nll", steps=args.sft_steps)
        result = {"pass@1": held_out(base, str(sft_dir / "final"), args.eval_size, args.threads)}
    else:  # RL at a sampled-token budget: from the SFT model with tools, or from the base model without
        overrides = [f"budget.max_tokens={args.budget_tokens}", "budget.max_steps=null", "eval.every=0",
                     f"eval.size={args.eval_size}", f"seed={seed}", f"model.threads={args.threads}",
                     "log.progress=false", "log.tensorboard=false", "checkpoint.every=0"]
        if name == "sft_rl":
            if not (sft_dir / "final").exists():
                run_sft(base, sft_dir, "nll", steps=args.sft_steps)
            overrides.append(f"model.path={sft_dir / 'final'}")
        else:
            overrides.append("rollout.agent=null")
        trainer = Trainer(load_recipe(RECIPE, overrides), runs / name)
        last = trainer.run()
        result = {"pass@1": last["eval/pass@1"], "tokens": last["tokens"]}
        (out.parent).mkdir(parents=True, exist_ok=True)
        (out.parent / "metrics.jsonl").write_text((runs / name / "metrics.jsonl").read_text())
    result["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    print(f"{name} seed {seed}: {result}", flush=True)
    return result


def throughput(args: argparse.Namespace, rows: int = 32) -> dict:
    """Sampled tokens/s of the agent loop and of plain generation, same model, prompts (with the tools
    described) and rows.

    The model is the seed-0 SFT model when it exists (it calls the calculator, so the loop really
    runs tool turns), else the recipe's base model."""
    sft = Path(args.runs) / "seed0" / "sft" / "final"
    recipe = load_recipe(RECIPE, [f"model.threads={args.threads}"] + ([f"model.path={sft}"] if sft.exists() else []))
    model, tok = load_model(recipe.model, for_training=False)
    problems = build_task(recipe.task, 0).train[: rows // 4]
    out = {}
    agent_rollout = recipe.rollout.model_copy(update={"backend": "hf"})
    described = build_generator(model, tok, agent_rollout, problems=problems).messages  # the tools in the prompt
    # both sample from the same prompts (the tools described); plain generation runs one call to eos
    for label, rollout in (("plain", recipe.rollout.model_copy(update={"agent": None, "backend": "hf"})),
                           ("agent", agent_rollout)):
        gen = build_generator(model, tok, rollout, problems=problems)
        requests = [Request(p.id, chat_ids(tok, described(p)), 4) for p in problems]
        gen.generate(requests[:1])  # warm-up
        t0 = time.perf_counter()
        rollouts = gen.generate(requests)
        seconds = time.perf_counter() - t0
        sampled = sum(len(r) for r in rollouts)
        out[label] = {"sampled_tokens": sampled, "seconds": seconds, "tokens_per_s": sampled / seconds,
                      "model": str(recipe.model.path)}
        if label == "agent":
            out[label].update({k: v for k, v in gen.metrics().items() if k in ("agent/tool_calls", "agent/turns_mean",
                                                                               "agent/inserted_tokens")})
        gen.close()
    out["ratio"] = out["agent"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--conditions", default="base_tools,sft,sft_rl,rl_no_tools")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--budget-tokens", type=int, default=30000)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", default="runs/bench-agent")
    parser.add_argument("--results", default="bench/results/agent")
    parser.add_argument("--throughput", action="store_true", help="also time the loop against plain generation")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    conditions = [c for c in args.conditions.split(",") if c]  # --conditions "": only --throughput
    unknown = set(conditions) - {"base_tools", "sft", "sft_rl", "rl_no_tools"}
    if unknown:
        parser.error(f"unknown conditions {sorted(unknown)}")
    table = {c: [run_condition(c, s, args)["pass@1"] for s in seeds] for c in conditions}
    print("\n| condition | seeds | held-out pass@1 per seed | mean |\n|---|---|---|---|")
    for c, values in table.items():
        print(f"| {c} | {len(values)} | {', '.join(f'{v:.3f}' for v in values)} | {np.mean(values):.3f} |")
    if args.throughput:
        t = throughput(args)
        plain, loop = t["plain"]["tokens_per_s"], t["agent"]["tokens_per_s"]
        print(f"\nsampled tokens/s: plain {plain:.1f}, agent loop {loop:.1f}, ratio {t['ratio']:.2f} ({t['agent']})")
        Path(args.results).mkdir(parents=True, exist_ok=True)
        (Path(args.results) / "throughput.json").write_text(json.dumps(t, indent=2))


if __name__ == "__main__":
    main()

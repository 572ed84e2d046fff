"""Tool use (default: 3-4-digit products, recipes/agent_calculator.yaml; any agent recipe with --recipe):
held-out greedy pass@1 of the base model with tools, after SFT cold start, after SFT + RL, and after
single-turn RL without tools at the same number of sampled tokens, with paired differences over seeds;
and the agent loop's sampled-token throughput against plain generation on the same model and prompts.

    .venv/bin/python bench/agent.py --seeds 0,1,2 --sft-steps 60 --budget-tokens 30000 --eval-size 200
    .venv/bin/python bench/agent.py --conditions sft,sft_rl --sft-steps 4 \
        --results bench/results/agent/cold4 --runs runs/bench-agent-cold4

    .venv/bin/python bench/agent.py --recipe recipes/agent_text_to_sql.yaml --task-name text_to_sql \
        --conditions sft,sft_rl,rl_no_tools --sft-steps 6 --sft-seed 0 --eval-size 50 --budget-tokens 2000 \
        --rl-set budget.prompts_per_step=2 --rl-set eval.at_start=false \
        --results bench/results/agent_text_to_sql --runs runs/bench-agent-text-to-sql

The second is the light cold start: 4 SFT steps teach the call format to about a fifth of the
problems (60 steps saturate the task, leaving RL nothing to add); the base and no-tool conditions do
not depend on the SFT steps and are shared. The third is text-to-SQL scored by executing the answer
query (issue 35): "RL without tools" answers in one turn (rollout.agent=null), and the reward still
executes its query; `--sft-seed 0` trains one cold start and starts every seed's RL from it, and
`--rl-set` passes recipe overrides to the RL runs only (the SFT runs keep the recipe's settings). That
setting is what fitted a contended 2-core CPU, and trains almost nothing (docs/benchmarks.md).
The printed table ends with the paired differences SFT + RL − SFT and SFT + RL − RL without tools:
mean Δ and 95% t interval over the seeds both conditions have (adarl.stats.paired).

Each finished run's result is kept under bench/results/agent/<condition>/seed<k>/ (commit them as
they finish; its metrics.jsonl is packed into the folder's runs.tar.gz, bench/results/README.md); a kept
run is not redone. Target (issue 15): SFT + RL at least 20 points above both SFT
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
from adarl.stats import paired
from adarl.tasks import build_task
from adarl.train.sft import run_sft
from adarl.train.trainer import Trainer
from adarl.types import Request

RECIPE = "recipes/agent_calculator.yaml"
CONDITIONS = ("base_tools", "sft", "sft_rl", "rl_no_tools")
PAIRS = (("sft_rl", "sft"), ("sft_rl", "rl_no_tools"))  # the paired differences the table ends with


def held_out(recipe, model_path: str | None, eval_size: int, threads: int, task_name: str = "products") -> float:
    """Greedy pass@1 on the held-out problems, with the recipe's rollout (the agent loop if it has one)."""
    if model_path:
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"path": model_path})})
    recipe.model.threads = threads
    model, tok = load_model(recipe.model, for_training=False)
    generator = build_generator(model, tok, recipe.rollout.model_copy(update={"backend": "hf"}))
    try:
        task = EvalTask(task_name, recipe.task, list(recipe.rewards), recipe.task.data_seed)
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
    runs = Path(args.runs) / f"seed{seed}"
    # --sft-seed K: one cold start (seed K's) for every seed; the seeds then vary RL only
    sft_seed = seed if args.sft_seed is None else args.sft_seed
    sft_dir = Path(args.runs) / f"seed{sft_seed}" / "sft"
    if name == "sft" and sft_seed != seed:  # the same model, evaluated greedily: the same result
        shared = kept(Path(args.results) / name / f"seed{sft_seed}" / "result.json")
        if shared is None:
            shared = run_condition(name, sft_seed, args)
        result = {"pass@1": shared["pass@1"], "shared_from_seed": sft_seed}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result))
        return result
    base = load_recipe(args.recipe, [f"seed={sft_seed}", f"model.threads={args.threads}", "log.progress=false",
                                     "log.tensorboard=false", "checkpoint.every=0", *args.set])  # seeds the SFT only
    t0 = time.perf_counter()
    if name == "base_tools":
        result = {"pass@1": held_out(base, None, args.eval_size, args.threads, args.task_name)}
    elif name == "sft":
        if not (sft_dir / "final").exists():
            run_sft(base, sft_dir, "nll", steps=args.sft_steps)
        result = {"pass@1": held_out(base, str(sft_dir / "final"), args.eval_size, args.threads, args.task_name)}
    else:  # RL at a sampled-token budget: from the SFT model with tools, or from the base model without
        overrides = [f"budget.max_tokens={args.budget_tokens}", "budget.max_steps=null", "eval.every=0",
                     f"eval.size={args.eval_size}", f"seed={seed}", f"model.threads={args.threads}",
                     "log.progress=false", "log.tensorboard=false", "checkpoint.every=0", *args.set, *args.rl_set]
        if name == "sft_rl":
            if not (sft_dir / "final").exists():
                run_sft(base, sft_dir, "nll", steps=args.sft_steps)
            overrides.append(f"model.path={sft_dir / 'final'}")
        else:
            overrides.append("rollout.agent=null")
        trainer = Trainer(load_recipe(args.recipe, overrides), runs / name)
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
    overrides = [f"model.threads={args.threads}", *args.set] + ([f"model.path={sft}"] if sft.exists() else [])
    recipe = load_recipe(args.recipe, overrides)
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


def paired_rows(table: dict[str, dict[int, float]]) -> list[dict]:
    """SFT + RL − SFT and SFT + RL − RL without tools, paired by seed, where both conditions ran."""
    rows = []
    for a, b in PAIRS:
        if a in table and b in table:
            rows.append({"a": a, "b": b, **paired(table[a], table[b])})
    return rows


def report(table: dict[str, dict[int, float]]) -> str:
    """The markdown table of per-seed held-out pass@1 and means, then the paired differences."""
    lines = ["| condition | seeds | held-out pass@1 per seed | mean |", "|---|---|---|---|"]
    for c, values in table.items():
        v = list(values.values())
        lines.append(f"| {c} | {len(v)} | {', '.join(f'{x:.3f}' for x in v)} | {np.mean(v):.3f} |")
    rows = paired_rows(table)
    if rows:
        lines += ["", "| paired Δ | seeds | Δ per seed | mean Δ [95% t CI] | W/L | verdict |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            ci = f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]" if r["ci95"] else "(no interval below 2 seeds)"
            mean = f"{r['mean']:+.3f}" if r["mean"] is not None else "n/a"
            per_seed = ", ".join(f"{d:+.3f}" for d in r["per_seed"].values())
            lines.append(f"| {r['a']} − {r['b']} | {r['n']} | {per_seed} | {mean} {ci} | {r['wins']}/{r['losses']} "
                         f"| {r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=RECIPE, help="the agent recipe (default: the calculator)")
    parser.add_argument("--task-name", default="products", help="the held-out evaluation's label")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--conditions", default="base_tools,sft,sft_rl,rl_no_tools")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--budget-tokens", type=int, default=30000)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", default="runs/bench-agent")
    parser.add_argument("--results", default="bench/results/agent")
    parser.add_argument("--sft-seed", type=int, default=None,
                        help="train one SFT cold start, with this seed, and start every seed's RL from it "
                             "(default: one per seed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every condition (repeat it), e.g. rollout.agent.max_turns=2")
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for the RL runs only (repeat it), e.g. budget.prompts_per_step=4")
    parser.add_argument("--throughput", action="store_true", help="also time the loop against plain generation")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    conditions = [c for c in args.conditions.split(",") if c]  # --conditions "": only --throughput
    unknown = set(conditions) - set(CONDITIONS)
    if unknown:
        parser.error(f"unknown conditions {sorted(unknown)}")
    table = {c: {s: run_condition(c, s, args)["pass@1"] for s in seeds} for c in conditions}
    print("\n" + report(table), flush=True)
    if args.throughput:
        t = throughput(args)
        plain, loop = t["plain"]["tokens_per_s"], t["agent"]["tokens_per_s"]
        print(f"\nsampled tokens/s: plain {plain:.1f}, agent loop {loop:.1f}, ratio {t['ratio']:.2f} ({t['agent']})")
        Path(args.results).mkdir(parents=True, exist_ok=True)
        (Path(args.results) / "throughput.json").write_text(json.dumps(t, indent=2))
    return {"table": table, "paired": paired_rows(table)}


if __name__ == "__main__":
    main()

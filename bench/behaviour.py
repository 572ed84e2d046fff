"""Behaviour unchanged across a refactor: five recipes trained a few steps give identical metrics rows.

    python bench/behaviour.py --out before.json      # on the old commit
    python bench/behaviour.py --out after.json --against before.json

The five recipes cover the stages a refactor of the seams touches: the fixed GRPO quickstart, VADE
selection with DARS allocation, partial rollouts (APRIL), an agent with a tool turn, and EPTree with
TreeRL credit. Each trains `--steps` steps on the embedded SmolLM2 with the hf decoder (deterministic
on a CPU), small batches, no evaluation or checkpoints. Timing, memory and throughput keys differ from
run to run and are left out; every other key of every row must be equal (floats exactly).

`--tiny --steps 1` is the smallest run (the test suite's tiny random model): tests/benchmarks/test_bench_smoke.py
runs it against a file that differs and checks that it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

RECIPES = {
    "fixed": "quickstart",
    "vade+dars": "select_vade_allocate_dars",
    "partial": "partial_april",
    "agent": "agent_calculator",
    "eptree+treerl": "branching_eptree",
}
SMALL = {"rollout.backend": "hf", "budget.prompts_per_step": 2, "rollout.max_new_tokens": 24,
         "eval.every": 0, "checkpoint.every": 0, "task.size": 64, "task.eval_size": 8}
PER_RECIPE = {"vade+dars": {"allocate.n": 4, "allocate.n_max": 8},
              "partial": {"rollout.max_batch": 16},
              # every trajectory has a tool turn: a gym-style environment answers each model turn
              "agent": {"rollout.agent.max_turns": 2, "rollout.agent.environment": "behaviour:Turns"}}
# keys that measure the machine, not the computation
VARYING = re.compile(r"(^|/)(time|timing|.*_s$|.*_per_s$|tokens_per_s|.*seconds.*|.*memory.*|.*_gib$|mfu|.*wall.*|"
                     r"throughput.*|.*utilization.*|.*idle.*|.*busy.*)")


class Turns:
    """A gym-style environment: it answers each model turn with its length, and ends after two."""

    def reset(self, **row) -> None:
        self.turns = 0

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.turns += 1
        return f"{len(action)} characters", 0.0, self.turns >= 2, {}


def run(name: str, steps: int, root: Path, model: str | None = None) -> list[dict]:
    from adarl import api

    overrides = {**SMALL, **PER_RECIPE.get(name, {}), "budget.max_steps": steps}
    if model is not None:  # and a graded reward the random model earns: its updates are not all zero
        overrides["model.path"] = model
        overrides["rewards"] = [{"type": "callable", "function": "e2e_rewards:fraction_of_a"}]
    if name != "vade+dars":
        overrides["allocate.n"] = 4
    api.train(RECIPES[name], run_dir=root / name.replace("+", "_"), overrides=overrides)
    rows = [json.loads(line) for line in (root / name.replace("+", "_") / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not VARYING.search(k)} for row in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", default=list(RECIPES))
    ap.add_argument("--against", help="a previous --out to compare with")
    ap.add_argument("--tiny", action="store_true",
                    help="the test suite's tiny random model instead of SmolLM2 (seconds a step on a busy CPU)")
    args = ap.parse_args()
    result: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.tiny:
            tests = str(Path(__file__).resolve().parents[1] / "tests")
            sys.path.insert(0, tests)
            os.environ["PYTHONPATH"] = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])  # reward workers
            from conftest import make_tiny_model_dir

            model = str(make_tiny_model_dir(Path(tmp) / "tiny"))
        for name in args.only:
            result[name] = run(name, args.steps, Path(tmp), model)
            Path(args.out).write_text(json.dumps(result, indent=1))  # finished runs kept as they go
            print(f"{name}: {len(result[name])} rows", flush=True)
    if not args.against:
        return 0
    before = json.loads(Path(args.against).read_text())
    bad = 0
    for name, rows in result.items():
        old = before.get(name)
        if old is None:
            print(f"{name}: not in {args.against}")
            continue
        for i, (a, b) in enumerate(zip(old, rows, strict=False)):
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if diff:
                bad += 1
                print(f"{name} row {i}: differs in {diff[:12]}" + (" ..." if len(diff) > 12 else ""))
        if len(old) != len(rows):
            bad += 1
            print(f"{name}: {len(old)} rows before, {len(rows)} after")
        print(f"{name}: {len(rows)} rows compared")
    print("identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The update's time and the process's peak memory against `train.micro_batch_tokens`.

Each setting trains the quickstart (SmolLM2-135M) for `--steps` steps from the same seed in its own
process, so every process's peak resident set (VmHWM) is its own. The update is the same at
every setting (tests/train/test_trainer_update.py: the micro-batch split does not change it). The
settings run in turn, `--rounds` times, so a slow moment of the machine falls on each of them.

    .venv/bin/python bench/micro_batch.py [--sizes 2048,1024,512] [--steps 2] [--rounds 2]

Run it with nothing else busy on the machine.

`--smoke --model TINY` is the smallest run (micro-batches of 64 and 32 tokens, one step of 2 prompts × 4
rollouts of up to 8 tokens, one round): tests/benchmarks/test_bench_smoke.py runs it on a tiny random
model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from smoke import smoke_overrides

CHILD = """
import json, sys
from pathlib import Path
from adarl.config import load_recipe
from adarl.train.trainer import Trainer
size, steps, run_dir, recipe_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
recipe = load_recipe(recipe_path, [f"train.micro_batch_tokens={size}", "log.progress=false", "log.tensorboard=false",
                                   *json.loads(sys.argv[5])])
trainer = Trainer(recipe, Path(run_dir))
rows = [trainer.train_step() for _ in range(steps)]
trainer.rewards.close()
peak = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
print(json.dumps({"train_s": [r["train_s"] for r in rows], "tokens": [r["step_tokens"] for r in rows],
                  "grad_norm": [r.get("grad_norm") for r in rows],
                  "peak_gib": peak / 1024**2}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048,1024,512")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/memory/micro_batch.json"))
    ap.add_argument("--recipe", default=str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"))
    ap.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    ap.add_argument("--smoke", action="store_true", help="the smallest run: sizes 64,32, 1 step of 2 prompts × 4 "
                    "rollouts of 8 tokens, 1 round (with a tiny --model, for tests; figures mean nothing)")
    args = ap.parse_args()
    overrides = [] if args.model is None else [f"model.path={args.model}"]
    if args.smoke:
        args.sizes, args.steps, args.rounds = "64,32", 1, 1
        overrides += smoke_overrides()  # with a reward the model earns: the step has an update to time
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, list[dict]] = {s: [] for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            with tempfile.TemporaryDirectory() as run_dir:
                out = subprocess.run([sys.executable, "-c", CHILD, str(size), str(args.steps), run_dir, args.recipe,
                                      json.dumps(overrides)],
                                     capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[size].append(row)
            print(f"micro_batch_tokens {size}: update {row['train_s']} s, peak {row['peak_gib']:.2f} GiB", flush=True)
    base = sizes[0]
    mean = {s: float(np.mean([t for r in rows for t in r["train_s"]])) for s, rows in results.items()}
    print(f"\n{'micro_batch_tokens':>18}{'update s':>10}{'×':>7}{'peak GiB':>10}")
    for s in sizes:
        peak = max(r["peak_gib"] for r in results[s])
        print(f"{s:>18}{mean[s]:>10.2f}{mean[s] / mean[base]:>7.2f}{peak:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "runs": {str(s): r for s, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()

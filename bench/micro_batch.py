"""The update's time and the process's peak memory against `train.micro_batch_tokens`.

Each setting trains the quickstart (SmolLM2-135M) for `--steps` steps from the same seed in its own
process, so every process's peak resident set (VmHWM) is its own. The update is the same at
every setting (tests/train/test_trainer_update.py: the micro-batch split does not change it). The
settings run in turn, `--rounds` times, so a slow moment of the machine falls on each of them.

    .venv/bin/python bench/micro_batch.py [--sizes 2048,1024,512] [--steps 2] [--rounds 2]

Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import json, sys
from pathlib import Path
from adarl.config import load_recipe
from adarl.train.trainer import Trainer
size, steps, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
recipe = load_recipe("recipes/quickstart.yaml", {"train.micro_batch_tokens": size, "log.progress": False,
                                                 "log.tensorboard": False})
trainer = Trainer(recipe, Path(run_dir))
rows = [trainer.train_step() for _ in range(steps)]
trainer.rewards.close()
peak = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
print(json.dumps({"train_s": [r["train_s"] for r in rows], "tokens": [r["step_tokens"] for r in rows],
                  "peak_gib": peak / 1024**2}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048,1024,512")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/memory/micro_batch.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, list[dict]] = {s: [] for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            with tempfile.TemporaryDirectory() as run_dir:
                out = subprocess.run([sys.executable, "-c", CHILD, str(size), str(args.steps), run_dir],
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

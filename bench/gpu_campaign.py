"""Issue 49 on the GPU machine: the quickstart with real weights, then the pre-registered campaign, in one command.

The pre-registration is docs/benchmarks.md's "GPU campaign (pre-registered)"; `DESIGN` below is its numbers and
`tests/benchmarks/test_gpu_campaign.py` checks that the two agree. The GPU machine has no reasoning-gym, so the
problems travel as jsonl written here (`--write-pools`, committed under bench/results/gpu/pools/): the quickstart's
2,000 training and 100 held-out problems, and the mixed pool cut to 40/80/80 training and 60/170/170 held-out
problems a share (easy, middle, hard). A test checks that a run reads from them exactly the problems the
reasoning-gym recipes build.

    .venv/bin/python bench/gpu_campaign.py --write-pools                          # here, once (committed)
    python3 bench/gpu_campaign.py --model /tmp/adarl-carry/hf --out $OUT --deadline-s 530   # there
    .venv/bin/python bench/gpu_campaign.py --report bench/results/gpu/campaign_h200/runs.json.gz  # here: the verdicts
    .venv/bin/python bench/gpu_campaign.py --smoke --device cpu --tiny /tmp/tiny --out DIR   # the CPU test's
    python3 bench/gpu_campaign.py --smoke --tiny /tmp/tiny --out $OUT/smoke --deadline-s 120  # there, first

There: the quickstart runs alone first (`--quickstart-s` at most), then every campaign run at once, launched
seed-major in waves while the card has memory for another wave (the first wave's footprint measures a run's);
every 10 s each run's metrics rows are gathered into `$OUT/runs.json.gz` (what comes back even if the command is
cut). At the deadline the runs still going are stopped (SIGINT, then SIGKILL) and recorded as stopped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from adarl.stats import holm, paired  # noqa: E402

POOLS = ROOT / "bench" / "results" / "gpu" / "pools"
#: the pre-registered design (docs/benchmarks.md, "GPU campaign (pre-registered)")
DESIGN = {
    "recipe": "mixed_pool",
    "shares": {"easy": (40, 60), "middle": (80, 170), "hard": (80, 170)},  # (training, held-out) problems
    "arms": ["uniform", "vade", "dars", "feature_prior"],
    "baseline": "uniform",
    "seeds": list(range(8)),
    "budget_tokens": 400_000,
    "eval_every_tokens": 50_000,
    "alpha": 0.05,
    "min_confirmatory_tokens": 100_000,
}
#: what makes a run use the card as the issue asks: bf16 mixed precision, adarl's hf decoder (CUDA graphs)
QUIET = ["reward_workers=1", "log.trackers=[]", "log.progress=false", "log.rollouts_every=0"]
DEVICE = {"cuda": ["model.device=cuda", "train.mixed_precision=bf16", "rollout.backend=hf", "rollout.max_batch=256",
                   "train.micro_batch_tokens=2048", "model.threads=1", *QUIET],
          "cpu": ["model.device=cpu", "rollout.backend=hf", *QUIET]}
#: the CPU test's setting: the same path, a tiny model, a few hundred tokens
SMOKE = {"budget_tokens": 160, "eval_every_tokens": 80, "seeds": [0, 1], "arms": DESIGN["arms"],
         "quickstart": ["budget.max_steps=2", "budget.prompts_per_step=2", "allocate.n=2", "eval.every=1"],
         "sizes": ["rollout.max_new_tokens=8", "budget.prompts_per_step=2", "train.micro_batch_tokens=512",
                   "eval.size=6", "task.eval_size=6"]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- the problems, written here


def problem_row(p) -> str:
    return json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer, **p.columns})


def campaign_mixture() -> list[dict]:
    from campaign import POOLS as CAMPAIGN_POOLS
    from campaign import shares

    return [{**s, "size": DESIGN["shares"][s["share"]][0], "eval_size": DESIGN["shares"][s["share"]][1]}
            for s in shares(CAMPAIGN_POOLS["mixed"])]


def source_overrides(kind: str) -> list[str]:
    """The reasoning-gym task a pool's jsonl files are written from (its recipe plus these)."""
    return [f"task.mixture={json.dumps(campaign_mixture())}"] if kind == "campaign" else []


def jsonl_overrides(kind: str, pools: Path = POOLS) -> list[str]:
    """What reads the same problems back from the jsonl files."""
    held = sum(e for _, e in DESIGN["shares"].values()) if kind == "campaign" else 100
    return ["task.source=jsonl", "task.mixture=null", "task.name=null", "task.params={}",
            f"task.path={pools / kind / 'train.jsonl'}", f"task.eval_path={pools / kind / 'heldout.jsonl'}",
            f"task.eval_size={held}", f"task.size={10**6}"]


def recipe_of(kind: str) -> Path:
    return ROOT / "recipes" / ("quickstart.yaml" if kind == "quickstart" else f"{DESIGN['recipe']}.yaml")


def write_pools(out: Path = POOLS) -> dict[str, tuple[int, int]]:
    from adarl.config import load_recipe
    from adarl.tasks import build_task

    counts = {}
    for kind in ("quickstart", "campaign"):
        task = build_task(load_recipe(recipe_of(kind), source_overrides(kind)).task)
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / "train.jsonl").write_text("".join(problem_row(p) + "\n" for p in task.train))
        (out / kind / "heldout.jsonl").write_text("".join(problem_row(p) + "\n" for p in task.eval))
        counts[kind] = (len(task.train), len(task.eval))
    return counts


# ---------------------------------------------------------------- the runs, there


def arm_overrides(arm: str) -> list[str]:
    from methods import METHODS

    return METHODS[arm]


def campaign_overrides(arm: str, seed: int, design: dict) -> list[str]:
    return [f"seed={seed}", f"budget.max_tokens={design['budget_tokens']}", "budget.max_steps=null",
            "eval.every=0", f"eval.every_tokens={design['eval_every_tokens']}", "eval.size=null",
            "checkpoint.every=0", *arm_overrides(arm)]


class Job:
    def __init__(self, name: str, recipe: Path, overrides: list[str], run_dir: Path):
        self.name, self.recipe, self.overrides, self.run_dir = name, recipe, overrides, run_dir
        self.proc: subprocess.Popen | None = None
        self.started = self.ended = None
        self.status = "queued"

    def start(self, env: dict) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        command = [sys.executable, "-m", "adarl.cli", "train", str(self.recipe), *self.overrides,
                   "--run-dir", str(self.run_dir)]
        self.log = (self.run_dir.parent / f"{self.run_dir.name}.log").open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started, self.status = time.time(), "running"

    def poll(self) -> None:
        if self.proc is not None and self.status == "running" and self.proc.poll() is not None:
            self.ended = time.time()
            self.status = "done" if self.proc.returncode == 0 else f"exit {self.proc.returncode}"
            self.log.close()

    def stop(self) -> None:
        if self.proc is not None and self.status == "running":
            os.killpg(self.proc.pid, signal.SIGINT)
            self.status = "stopped"

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else ():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                break
        return rows

    def record(self) -> dict:
        tail = ""
        if self.status.startswith("exit"):
            text = (self.run_dir.parent / f"{self.run_dir.name}.log").read_text(errors="replace")
            tail = text[-3000:]
        return {"status": self.status, "seconds": round((self.ended or time.time()) - self.started, 1)
                if self.started else None, "overrides": self.overrides, "rows": self.rows(),
                **({"log_tail": tail} if tail else {})}


def free_gib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split(",")
        return float(out[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def run_jobs(jobs: list[Job], deadline: float, out: Path, name: str, wave: int, env: dict,
             reserve_gib: float = 8.0) -> None:
    """Every job at once, in waves of `wave` while the card has memory for another (a run's footprint is read
    40 s after the first wave starts); `out`/`name` gathered every 10 s; at `deadline` the ones still running
    are stopped (SIGINT, then SIGKILL); none is left running when this returns or raises."""
    queue, last_dump, per_run, launched = list(jobs), 0.0, None, time.time()

    def dump() -> None:
        tmp, text = out / f".{name}.tmp", json.dumps({j.name: j.record() for j in jobs}).encode()
        tmp.write_bytes(gzip.compress(text, 6) if name.endswith(".gz") else text)
        tmp.replace(out / name)

    try:
        while True:
            for j in jobs:
                j.poll()
            running = [j for j in jobs if j.status == "running"]
            if queue and time.time() < deadline - 60:
                free = free_gib()
                if not running or free is None or (per_run is not None and free - reserve_gib > wave * per_run):
                    for j in queue[:wave]:
                        j.start(env)
                    log(f"{name}: started {', '.join(j.name for j in queue[:wave])} (free {free} GiB)")
                    queue, launched = queue[wave:], time.time()
                elif per_run is None and time.time() - launched > 40:
                    per_run = (TOTAL_GIB - free) / len(running)
                    log(f"{name}: a run holds about {per_run:.1f} GiB of the card; {free:.1f} GiB free")
            running = [j for j in jobs if j.status == "running"]
            if not queue and not running:
                break
            if time.time() >= deadline:
                for j in running:
                    j.stop()
                log(f"{name}: deadline; stopped {len(running)} run(s), {len(queue)} never started")
                time.sleep(8)
                break
            if time.time() - last_dump > 10:
                dump()
                last_dump = time.time()
            time.sleep(1)
    finally:
        for j in jobs:
            if j.proc is not None and j.proc.poll() is None:
                os.killpg(j.proc.pid, signal.SIGKILL)
        dump()


TOTAL_GIB = 0.0


def device_card() -> dict:
    import torch

    global TOTAL_GIB
    card = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        TOTAL_GIB = p.total_memory / 2**30
        card |= {"name": p.name, "memory_gib": round(TOTAL_GIB, 1), "sm": p.multi_processor_count}
    try:
        import transformers

        card["transformers"] = transformers.__version__
    except ImportError:
        pass
    card["cpus"] = os.cpu_count()
    return card


def run_there(args: argparse.Namespace) -> None:
    # a `timeout` or the device tool ends this command with SIGTERM: unwind, so run_jobs stops its runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    deadline = t0 + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs)
    design = {**DESIGN, **({k: SMOKE[k] for k in ("budget_tokens", "eval_every_tokens", "seeds", "arms")}
                           if args.smoke else {})}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    device = DEVICE[args.device] + (SMOKE["sizes"] if args.smoke else [])
    card = device_card() if args.device == "cuda" else {"device": "cpu"}
    (out / "card.json").write_text(json.dumps({**card, "design": design, "device_overrides": device}, indent=1))
    log(f"card: {card}")
    model = [f"model.path={args.model}"]
    if "quickstart" in args.parts:
        qs = Job("quickstart", recipe_of("quickstart"), model + device + jsonl_overrides("quickstart")
                 + ["checkpoint.every=0"] + (SMOKE["quickstart"] if args.smoke else []), runs / "quickstart")
        run_jobs([qs], min(deadline, time.time() + args.quickstart_s), out, "quickstart.json", 1, env)
        log(f"quickstart: {qs.status} in {qs.record()['seconds']} s")
    if "campaign" in args.parts:
        jobs = [Job(f"{arm}/seed{seed}", recipe_of("campaign"),
                    model + device + jsonl_overrides("campaign") + campaign_overrides(arm, seed, design),
                    runs / arm / f"seed{seed}")
                for seed in design["seeds"] for arm in design["arms"]]
        run_jobs(jobs, deadline, out, "runs.json.gz", args.wave, env)
        states = [j.status for j in jobs]
        log(f"campaign: {', '.join(f'{s} {states.count(s)}' for s in sorted(set(states)))}")
    log(f"all done in {time.time() - t0:.0f} s")


# ---------------------------------------------------------------- the analysis, here


def at_points(rows: list[dict], every: int, budget: int, finished: bool) -> dict[int, float]:
    """Held-out pass@1 at each fixed token point 0, every, 2 every, ... budget: the evaluation the run made for
    that point (its first at or after it). A `finished` run's final evaluation is its budget's point (its last
    step may stop a few tokens short of the budget). A point the run never reached is absent."""
    evals = [(r["tokens"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    values = {}
    for point in range(0, budget + 1, every):
        later = [acc for tok, acc in evals if tok >= point]
        if later:
            values[point] = later[0]
    if finished and evals:
        values[budget] = evals[-1][1]
    return values


def auc(values: dict[int, float], upto: int) -> float | None:
    """Trapezoid area of pass@1 over the fixed points 0..`upto`, over `upto` (the same points for every arm)."""
    points = sorted(p for p in values if p <= upto)
    if not points or points[-1] != upto or points[0] != 0:
        return None
    return sum((b - a) * (values[a] + values[b]) / 2 for a, b in zip(points, points[1:], strict=False)) / upto


def analyse(runs: dict[str, dict], design: dict = DESIGN) -> dict:
    """The pre-registered analysis: the point of analysis (the budget, or the largest fixed point every run
    reached), per contrast the paired Δ pass@1 at that point and of the AUC to it, each with its t interval and
    p value, Holm-corrected over the contrasts (each metric its own family)."""
    every, budget = design["eval_every_tokens"], design["budget_tokens"]
    curves = {name: at_points(r["rows"], every, budget, r["status"] == "done") for name, r in runs.items()}
    seeds = [s for s in design["seeds"] if all(f"{a}/seed{s}" in curves for a in design["arms"])]
    reached = [max(curves[f"{a}/seed{s}"], default=-1) for a in design["arms"] for s in seeds]
    point = min(reached) if reached else -1
    out: dict = {"point": point, "seeds": seeds, "confirmatory": point >= design["min_confirmatory_tokens"]
                 and len(seeds) >= len(design["seeds"]), "contrasts": {}}
    if point < 0:
        return out
    value = {(a, s): curves[f"{a}/seed{s}"][point] for a in design["arms"] for s in seeds}
    area = {(a, s): auc(curves[f"{a}/seed{s}"], point) if point > 0 else None for a in design["arms"] for s in seeds}
    base = design["baseline"]
    out["pass@1"] = {a: sum(value[a, s] for s in seeds) / len(seeds) for a in design["arms"]}
    for metric, table in (("pass@1", value), ("auc", area)):
        tests = {a: paired({s: table[a, s] for s in seeds}, {s: table[base, s] for s in seeds})
                 for a in design["arms"] if a != base}
        adjusted = holm({a: t["p"] for a, t in tests.items()}, design["alpha"])
        for a, t in tests.items():
            out["contrasts"].setdefault(a, {})[metric] = {**t, **adjusted[a]}
    return out


def print_report(result: dict, runs: dict[str, dict]) -> None:
    print(f"point of analysis: {result['point']} sampled tokens; paired seeds {result['seeds']}; "
          f"confirmatory: {result['confirmatory']}")
    if "pass@1" in result:
        print("mean held-out pass@1 at that point: " + ", ".join(f"{a} {v:.3f}" for a, v in result["pass@1"].items()))
    print("| contrast | metric | mean Δ | 95% CI (raw) | p | Holm p | Holm verdict | wins/losses |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, metrics in result["contrasts"].items():
        for metric, t in metrics.items():
            ci = f"[{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]" if t["ci95"] else "-"
            p = f"{t['p']:.3f}" if t["p"] is not None else "-"
            hp = f"{t['holm_p']:.3f}" if t["holm_p"] is not None else "-"
            mean = f"{t['mean']:+.3f}" if t["mean"] is not None else "-"
            print(f"| {arm} − uniform | {metric} | {mean} | {ci} | {p} | {hp} | {t['holm_verdict']} | "
                  f"{t['wins']}/{t['losses']} |")
    status = {}
    for r in runs.values():
        status[r["status"]] = status.get(r["status"], 0) + 1
    print(f"runs: {status}")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-pools", action="store_true", help="here: write the problems as jsonl")
    parser.add_argument("--report", type=Path, default=None, help="here: the analysis of a runs.json")
    parser.add_argument("--model", default=None, help="model.path of every run (there: the converted folder)")
    parser.add_argument("--out", default="bench/out/gpu_campaign")
    parser.add_argument("--runs", default="/tmp/adarl-gpu-runs")
    parser.add_argument("--parts", default="quickstart,campaign")
    parser.add_argument("--deadline-s", type=float, default=530)
    parser.add_argument("--quickstart-s", type=float, default=150)
    parser.add_argument("--wave", type=int, default=8, help="runs launched together")
    parser.add_argument("--device", choices=sorted(DEVICE), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting (the CPU test's, on a tiny --model)")
    parser.add_argument("--tiny", type=Path, default=None, help="build the tests' tiny random model here and use it")
    args = parser.parse_args(argv)
    if args.write_pools:
        for kind, (n_train, n_held) in write_pools().items():
            print(f"{kind}: {n_train} training, {n_held} held-out problems -> {POOLS / kind}")
        return None
    if args.report:
        data = args.report.read_bytes()
        runs = json.loads(gzip.decompress(data) if args.report.suffix == ".gz" else data)
        card = args.report.parent / "card.json"  # the design the runs were launched with
        design = json.loads(card.read_text())["design"] if card.exists() else DESIGN
        result = analyse(runs, design)
        print_report(result, runs)
        return result
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_model_dir

        make_tiny_model_dir(args.tiny)
        args.model = str(args.tiny)
    if not args.model:
        parser.error("--model (or --tiny) is required to train")
    run_there(args)
    return None


if __name__ == "__main__":
    main()

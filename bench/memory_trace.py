"""Where a training run's memory goes: the resident set size of the whole process, sampled every
50 ms through a run of the quickstart (or any recipe), attributed to the phase running at the time
(loading, generation, verification, the update, the weight push into a vLLM engine, held-out
evaluation, checkpoints, `final/`, the report). Prints each phase's peak RSS and the run's peak
(VmHWM), as issue 20 asks: trace the quickstart's peak before fixing it.

    .venv/bin/python bench/memory_trace.py [--recipe recipes/quickstart.yaml] [--steps 4] [--out trace.json]

Memory, unlike time, is not skewed by other processes on the machine.

`--smoke --model TINY` is the smallest run through every phase (2 steps of 2 prompts × 2 rollouts of up to
8 tokens, the hf backend, an evaluation and a checkpoint): tests/benchmarks/test_bench_smoke.py runs it on
a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from adarl.config import load_recipe
from adarl.train import loop
from adarl.train.trainer import Trainer
from smoke import smoke_overrides


def _status(field: str) -> float:
    """A /proc/self/status field in GB (VmRSS: now, VmHWM: the peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


class Tracer:
    def __init__(self) -> None:
        self.phase = "load"
        self.peaks: dict[str, float] = {}
        self.timeline: list[tuple[float, str, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._record()
            time.sleep(0.05)

    def _record(self) -> None:
        with self._lock:
            rss, phase = _status("VmRSS"), self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), rss)
            self.timeline.append((time.perf_counter() - self._t0, phase, rss))

    def wrap(self, obj: object, name: str, phase: str, inside: bool = False) -> None:
        """Attribute the time inside obj.name(...) to `phase` (nested calls keep the outer phase, unless
        `inside`: then the call is its own phase wherever it runs)."""
        inner = getattr(obj, name)

        def traced(*args, **kw):
            outer = self.phase
            self.phase = phase if inside or outer in ("step", "run") else outer
            try:
                return inner(*args, **kw)
            finally:
                self._record()  # a phase shorter than the sampling interval is still seen once, at its end
                self.phase = outer

        setattr(obj, name, traced)

    def __enter__(self) -> Tracer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-trim", action="store_true", help="without the loop's malloc_trim after each step")
    parser.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 steps × 2 prompts × 2 rollouts, "
                        "8 new tokens (with a tiny --model, for tests; figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 2
    overrides = [f"budget.max_steps={args.steps}", f"eval.every={max(args.steps // 2, 1)}",
                 f"checkpoint.every={max(args.steps // 2, 1)}", "log.progress=false"]
    if args.threads:
        overrides.append(f"model.threads={args.threads}")
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.smoke:
        overrides += smoke_overrides(n=2)
    with Tracer() as tr, tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_recipe(args.recipe, overrides), Path(tmp) / "run")
        tr.phase = "run"
        for name, phase in (("rollout_and_verify", "generate+verify"), ("learn", "update")):
            tr.wrap(trainer, name, phase)
        import adarl.train.trainer as trainer_module

        tr.wrap(trainer_module, "hint_rung", "hints")
        tr.wrap(trainer.generator, "load_weights", "weight push", inside=True)  # the vllm engine's copy
        if args.no_trim:  # the loop's malloc_trim after every step, switched off (the before)
            loop.release_memory = lambda: None
        tr.wrap(trainer, "train_step", "step")
        for name, phase in (("evaluate", "eval"), ("save_checkpoint", "checkpoint"), ("save_final", "final")):
            tr.wrap(loop, name, phase)
        import adarl.report

        tr.wrap(adarl.report, "write_report", "report")
        loop.run(trainer)
    peak = _status("VmHWM")
    print("\n| phase | peak RSS (GB) |\n|---|---|")
    for phase, gb in sorted(tr.peaks.items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {gb:.2f} |")
    print(f"\nprocess peak (VmHWM): {peak:.2f} GB")
    if args.out:
        Path(args.out).write_text(json.dumps({"peaks": tr.peaks, "vmhwm_gb": peak, "timeline": tr.timeline}))


if __name__ == "__main__":
    main()

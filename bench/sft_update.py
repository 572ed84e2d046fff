"""SFT steps with their micro-batches laid out two ways (train/sft.py, train/logprobs.py `pack`).

    .venv/bin/python bench/sft_update.py [--recipe recipes/agent_calculator.yaml] [--steps 6] [--objective nll]
                                         [--threads T] [--model PATH] [--out FILE]

The same recipe, seed and steps, run twice in turn: with the learner's layout (shared: rows end to end, a token
prefix common to several examples, such as the chat template's system turn, forwarded and back-propagated once)
and with right-padded rows (what `adarl sft` did before). Reported per layout: seconds per step (the median of
steps 2..N, from metrics.jsonl's `wall_s`: step 1 warms up), tokens forwarded per step (as `pack` built them),
the final loss, and the shared/padded ratios. The two train alike (tests/objectives/test_otr.py).

`--smoke --model TINY`: 2 steps on a tiny model (tests/benchmarks/test_sft_update_bench.py); its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "agent_calculator.yaml"
LAYOUTS = ("shared", "padded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--objective", choices=("nll", "otr"), default="nll")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write every number as JSON")
    ap.add_argument("--smoke", action="store_true", help="2 steps (figures mean nothing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps = 2
    if args.steps < 2:
        ap.error("--steps: at least 2 (step 1 warms up and is not timed)")
    return args


def run(args: argparse.Namespace, layout: str, folder: Path) -> dict[str, Any]:
    """One `run_sft` with `layout`; the tokens `pack` laid out, counted on the way."""
    import adarl.train.sft as sft
    from adarl.config import load_recipe

    overrides = [f"model.path={args.model}"] * bool(args.model) + [f"model.threads={args.threads}"] * bool(args.threads)
    recipe = load_recipe(args.recipe, [*overrides, "log.tensorboard=false"])
    forwarded: list[int] = []
    pack, layout_for = sft.pack, sft.layout_for

    def counting(*a: Any, **kw: Any) -> Any:
        packed = pack(*a, **kw)
        forwarded.append(packed.tokens)
        return packed

    sft.pack = counting
    if layout == "padded":
        sft.layout_for = lambda model: "padded"
    try:
        sft.run_sft(recipe, folder / layout, args.objective, steps=args.steps)
    finally:
        sft.pack, sft.layout_for = pack, layout_for
    rows = [json.loads(line) for line in (folder / layout / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall_s"] for r in rows]
    return {"s_per_step": statistics.median(b - a for a, b in zip(walls, walls[1:], strict=False)),
            "forwarded_per_step": sum(forwarded) / len(rows), "trained_per_step": rows[-1]["tokens"],
            "final_loss": rows[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = {layout: run(args, layout, Path(tmp)) for layout in LAYOUTS}
    shared, padded = out["shared"], out["padded"]
    ratios = {"s_per_step": shared["s_per_step"] / padded["s_per_step"],
              "forwarded_per_step": shared["forwarded_per_step"] / padded["forwarded_per_step"]}
    print("| layout | s/step | tokens forwarded/step | answer tokens/step | final loss |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for layout, r in out.items():
        print(f"| {layout} | {r['s_per_step']:.3f} | {r['forwarded_per_step']:.0f} | {r['trained_per_step']} | "
              f"{r['final_loss']:.4f} |")
    print(f"shared / padded: {ratios['s_per_step']:.2f}x the time a step, "
          f"{ratios['forwarded_per_step']:.2f}x the tokens forwarded")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "layouts": out,
                                        "ratios": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

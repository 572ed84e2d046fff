"""adarl vs TRL's GRPOTrainer: step time on the same model, task and hyper-parameters.

Run (CPU, a few minutes at the defaults)::

    .venv/bin/python bench/vs_trl.py [--steps 4] [--prompts 4] [--n 8] [--max-new-tokens 64]
                                     [--threads T] [--model PATH] [--out result.json]

``--smoke --model TINY`` is the smallest run through every part (2 steps, the first a warm-up, of
2 prompts × 2 completions of up to 8 tokens each side): tests/benchmarks/test_bench.py runs it on a tiny
random model. Its times mean nothing.

Both trainers run in this one process, adarl first, then TRL (``trl==1.16.0``, the ``bench``
extra: ``trl`` and ``datasets``), each on its own fresh copy of SmolLM2-135M-Instruct (float32,
loaded offline from adarl's converted cache), with the same number of torch threads. What is equal:

- the task and prompts: the quickstart recipe's problems (additions of two numbers 0-100, its system prompt),
  TRL gets exactly the problems adarl's uniform selector picked, in the same order and as the
  same chat messages; the prompt token ids each side generates from are compared and reported;
- per step: ``--prompts`` prompts × ``--n`` completions, generated once, then one optimizer step
  (TRL: ``per_device_train_batch_size = prompts·n``, ``steps_per_generation = 1``,
  ``gradient_accumulation_steps = 1``, ``num_iterations = 1``);
- sampling: temperature from the recipe (0.7), top-p 1, no top-k, ``--max-new-tokens``;
- the objective: GRPO advantages scaled by the group std, PPO clip 0.2 / 0.28, token-mean
  aggregation (TRL ``loss_type="dapo"``), no KL (beta 0), no entropy bonus;
- the optimizer: ``torch.optim.AdamW`` (TRL ``optim="adamw_torch"``), the recipe's lr, constant
  schedule, no warmup, no weight decay, gradient clipping at 1.0, float32, no gradient
  checkpointing (TRL's default turns it on; it is turned off here, as in adarl's recipe);
- the reward: adarl's ``short_answer.score`` (last number of the completion == answer) for both.

Timing: adarl's step is ``Trainer.train_step()`` (select, generate, verify, advantages, update);
TRL's is ``on_step_begin`` → ``on_step_end`` of a ``TrainerCallback`` (generation, scoring,
forward/backward, clip, optimizer step). The first step of each is a warm-up and is excluded;
the median of the rest is compared. Generation time (adarl's ``generate_s``, TRL's
``_generate_single_turn`` wrapped with a timer) gives generation-only tokens/s.

What differs, and cannot be made equal:

- the sampled completions: each side draws from its own random stream, so completion lengths
  and rewards differ; step time grows with completion length, so mean lengths are reported
  beside the times, with a per-generated-token ratio;
- implementation choices that leave the gradient unchanged: adarl skips the forward/backward of
  rollouts whose advantage is 0 (groups with all-equal rewards) and packs the rest into
  micro-batches of ``train.micro_batch_tokens`` tokens (packed, a group's prompt forwarded once); TRL runs every
  row in one batch;
- the std epsilon of the advantage (adarl 1e-6, TRL 1e-4), immaterial for 0/1 rewards;
- TRL's per-step logging and metric bookkeeping is inside its step, as it would be in a real run.

Run it on a quiet machine: it measures how busy the CPUs are for 2 s before starting and notes it
when other work was running. The table is printed; ``--out`` also writes every number as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="steps per trainer; the first is a warm-up")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--model", default=None, help="model for both, a path or alias (default: the recipe's)")
    p.add_argument("--smoke", action="store_true", help="the smallest run: 2 steps × 2 prompts × 2 completions, "
                                                        "8 new tokens (with a tiny --model, for tests)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.n, args.max_new_tokens = 2, 2, 2, 8
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is excluded as a warm-up)")
    return args


def as_messages(prompt: Any) -> list[dict[str, str]]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Fraction of all CPUs busy over `seconds` (Linux /proc/stat), measured before any work here."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(seconds)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in load)


def summarize(step_s: list[float], gen_s: list[float], tokens: list[int], lengths: list[float],
              rewards: list[float], zero_var: list[float]) -> dict[str, Any]:
    """Per-step lists → the numbers compared; the first step is the warm-up."""
    t, g, k = step_s[1:], gen_s[1:], tokens[1:]
    return {
        "step_s": step_s,
        "generate_s": gen_s,
        "step_tokens": tokens,
        "mean_completion_length_per_step": lengths,
        "reward_per_step": rewards,
        "zero_variance_fraction_per_step": zero_var,
        "median_step_s": statistics.median(t),
        "median_generate_s": statistics.median(g),
        "median_rest_s": statistics.median(a - b for a, b in zip(t, g, strict=True)),
        "mean_completion_length": statistics.fmean(lengths[1:]),
        "tokens_per_step": statistics.fmean(k),
        "tokens_per_s": sum(k) / sum(t),  # generated tokens per second of whole step
        "generate_tokens_per_s": sum(k) / sum(g),  # generated tokens per second of generation
        "s_per_token": sum(t) / max(sum(k), 1),
        "reward": statistics.fmean(rewards[1:]),
        "zero_variance_fraction": statistics.fmean(zero_var[1:]),
    }


# ---------------------------------------------------------------- adarl


def run_adarl(args: argparse.Namespace, threads: int) -> tuple[dict[str, Any], list, list[list[int]], dict]:
    import torch

    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer

    overrides = [
        f"budget.max_steps={args.steps}", f"budget.prompts_per_step={args.prompts}", f"allocate.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"model.threads={threads}",
        "eval.every=0", "eval.at_start=false", "checkpoint.every=0",
        "log.tensorboard=false", "log.progress=false", *([f"model.path={args.model}"] if args.model else []),
    ]
    recipe = load_recipe(RECIPE, overrides)
    with tempfile.TemporaryDirectory(prefix="vs_trl_adarl_") as run_dir:
        trainer = Trainer(recipe, Path(run_dir))
        picked: list[list[int]] = []
        select = trainer.selector.select

        def recording_select(n_problems, k, rng):
            chosen = select(n_problems, k, rng)
            picked.append(list(chosen))
            return chosen

        trainer.selector.select = recording_select
        rows = []
        try:
            for i in range(args.steps):
                m = trainer.train_step()
                rows.append(m)
                print(f"  adarl step {i + 1}/{args.steps}: {m['step_s']:.2f} s "
                      f"(generate {m['generate_s']:.2f} s, train {m['train_s']:.2f} s), "
                      f"{m['step_tokens']} tokens, mean length {m['response_length']:.1f}, "
                      f"reward {m['reward']:.3f}", flush=True)
        finally:
            trainer.rewards.close()
        assert torch.get_num_threads() == threads, "adarl changed the thread count"
        problems = [[trainer.task.train[i] for i in step] for step in picked]
        prompt_ids = [[trainer.prompt_ids(p) for p in step] for step in problems]
        hp = {
            "lr": recipe.train.lr, "temperature": recipe.rollout.temperature, "top_p": recipe.rollout.top_p,
            "eps_low": recipe.loss["eps_low"], "eps_high": recipe.loss["eps_high"],
            "agg": recipe.loss["agg"], "max_grad_norm": recipe.train.max_grad_norm,
            "weight_decay": recipe.train.weight_decay, "betas": list(recipe.train.betas),
            "warmup_steps": recipe.train.warmup_steps, "model": recipe.model.path, "dtype": recipe.model.dtype,
            "seed": recipe.seed, "micro_batch_tokens": recipe.train.micro_batch_tokens,
        }
        if recipe.loss.get("kl_coef", 0.0) or recipe.model.lora is not None or recipe.model.dtype != "float32":
            raise SystemExit("the recipe must be full fine-tuning in float32 without KL for this comparison")
        del trainer
    gc.collect()
    result = summarize(
        [r["step_s"] for r in rows], [r["generate_s"] for r in rows], [int(r["step_tokens"]) for r in rows],
        [r["response_length"] for r in rows], [r["reward"] for r in rows],
        [r["zero_variance_fraction"] for r in rows],
    )
    result["train_s"] = [r["train_s"] for r in rows]
    result["trained_fraction_per_step"] = [r.get("trained_fraction", 0.0) for r in rows]
    result["trained_fraction"] = statistics.fmean(result["trained_fraction_per_step"][1:])
    return result, problems, prompt_ids, hp


# ---------------------------------------------------------------- TRL


def last_number_reward(prompts, completions, answer, **_):
    """adarl's short_answer reward (extract the last number, compare numerically), TRL's signature."""
    from adarl.rewards import short_answer

    out = []
    for completion, ans in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(short_answer.score(text, None if ans is None else str(ans), "last_number", "numeric"))
    return out


def run_trl(args: argparse.Namespace, threads: int, problems: list, hp: dict) -> tuple[dict[str, Any], list]:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from adarl.config import ModelConfig
    from adarl.models import load_model

    model, tokenizer = load_model(ModelConfig(path=hp["model"], dtype=hp["dtype"]), for_training=True)
    flat = [p for step in problems for p in step]
    dataset = Dataset.from_list([{"prompt": as_messages(p.prompt), "answer": p.answer} for p in flat])
    batch = args.prompts * args.n

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.threads: list[int] = []
            self.checkpointing: list[bool] = []

        def on_step_begin(self, _args, state, control, model=None, **kwargs):
            self.threads.append(torch.get_num_threads())
            self.checkpointing.append(bool(model is not None and model.is_gradient_checkpointing))
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    with tempfile.TemporaryDirectory(prefix="vs_trl_trl_") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            max_steps=args.steps,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            num_generations=args.n,
            max_completion_length=args.max_new_tokens,
            temperature=hp["temperature"],
            top_p=hp["top_p"],
            top_k=0,
            learning_rate=hp["lr"],
            lr_scheduler_type="constant",
            warmup_steps=hp["warmup_steps"],
            weight_decay=hp["weight_decay"],
            adam_beta1=hp["betas"][0],
            adam_beta2=hp["betas"][1],
            optim="adamw_torch",
            max_grad_norm=hp["max_grad_norm"] if hp["max_grad_norm"] is not None else 0.0,
            beta=0.0,
            loss_type="dapo",  # token-mean over the whole batch, adarl's agg: token-mean
            epsilon=hp["eps_low"],
            epsilon_high=hp["eps_high"],
            scale_rewards="group",
            mask_truncated_completions=False,
            shuffle_dataset=False,
            gradient_checkpointing=False,  # TRL's default is on; adarl's recipe has it off
            bf16=False,
            fp16=False,
            use_cpu=True,
            seed=hp["seed"],
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=model, reward_funcs=[last_number_reward], args=config, train_dataset=dataset,
            processing_class=tokenizer, callbacks=[timer],
        )
        gen_s: list[float] = []
        gen_tokens: list[int] = []
        gen_prompts: list[list[list[int]]] = []
        generate = trainer._generate_single_turn

        def timed_generate(prompt_ids, *a, **k):
            t0 = time.perf_counter()
            completion_ids, logprobs = generate(prompt_ids, *a, **k)
            gen_s.append(time.perf_counter() - t0)
            gen_tokens.append(sum(len(c) for c in completion_ids))
            gen_prompts.append([list(map(int, p)) for p in prompt_ids])
            return completion_ids, logprobs

        trainer._generate_single_turn = timed_generate
        trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the timings are printed below
        torch.set_num_threads(threads)
        trainer.train()
        del trainer, model
    gc.collect()
    if len(timer.step_s) != args.steps or len(gen_s) != args.steps:
        raise RuntimeError(f"TRL ran {len(timer.step_s)} steps and {len(gen_s)} generations, "
                           f"expected {args.steps} of each")
    if any(t != threads for t in timer.threads):
        raise RuntimeError(f"TRL ran with {timer.threads} threads, expected {threads}")
    if any(timer.checkpointing):
        raise RuntimeError("TRL ran with activation checkpointing on")
    lengths = [log["completions/mean_length"] for log in timer.logs]
    rewards = [log.get("reward", float("nan")) for log in timer.logs]
    zero_var = [log.get("frac_reward_zero_std", float("nan")) for log in timer.logs]
    for i, s in enumerate(timer.step_s):
        print(f"  trl   step {i + 1}/{args.steps}: {s:.2f} s (generate {gen_s[i]:.2f} s), "
              f"{gen_tokens[i]} tokens, mean length {lengths[i]:.1f}, reward {rewards[i]:.3f}", flush=True)
    result = summarize(timer.step_s, gen_s, gen_tokens, lengths, rewards, zero_var)
    result["trained_fraction"] = 1.0  # TRL runs forward/backward on every row
    # each prompt appears n times in a row in TRL's generation batch: keep one per group
    unique_prompts = [step[:: args.n] for step in gen_prompts]
    return result, unique_prompts


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    busy_start = cpu_busy()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import transformers
    import trl

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    print(f"adarl vs TRL {trl.__version__}: {args.steps} steps × {args.prompts} prompts × {args.n} completions, "
          f"≤{args.max_new_tokens} new tokens, {threads} torch threads", flush=True)

    print("adarl:", flush=True)
    adarl, problems, adarl_prompts, hp = run_adarl(args, threads)
    print("TRL:", flush=True)
    trl_result, trl_prompts = run_trl(args, threads, problems, hp)

    load_end = os.getloadavg()
    same_prompts = adarl_prompts == trl_prompts
    ratio = adarl["median_step_s"] / trl_result["median_step_s"]
    ratio_per_token = adarl["s_per_token"] / trl_result["s_per_token"]
    len_ratio = adarl["mean_completion_length"] / trl_result["mean_completion_length"]

    notes = []
    if not same_prompts:
        notes.append("the prompt token ids differ between adarl and TRL")
    if not 0.8 <= len_ratio <= 1.25:
        notes.append(f"mean completion lengths differ (adarl/TRL = {len_ratio:.2f}): step time grows with length, "
                     "so read the per-token ratio too")
    if adarl["trained_fraction"] < 1.0:
        notes.append(f"adarl ran forward/backward on {adarl['trained_fraction']:.0%} of the rollouts (the rest had "
                     "advantage 0, i.e. groups with all-equal rewards, and carry no gradient); TRL trains on all of "
                     "them: part of the step-time gap is this skip, which depends on the reward mix")
    if busy_start is not None and busy_start > 0.2:
        notes.append(f"the CPUs were {busy_start:.0%} busy with other work just before the benchmark started: "
                     "it may have slowed either side")
    notes += [
        "completions are sampled from different random streams (lengths and rewards differ)",
        "adarl skips forward/backward of zero-advantage rollouts and micro-batches the rest "
        f"({hp['micro_batch_tokens']} tokens, packed by shared prompt); TRL runs all rows in one batch (same gradient)",
        "advantage std epsilon: adarl 1e-6, TRL 1e-4",
        "adarl ran first, TRL second, in the same process",
    ]

    rows = [
        ("median step (s)", "median_step_s", "{:.2f}"),
        ("median generate (s)", "median_generate_s", "{:.2f}"),
        ("generated tokens / step", "tokens_per_step", "{:.0f}"),
        ("mean completion length", "mean_completion_length", "{:.1f}"),
        ("generated tok/s (step)", "tokens_per_s", "{:.1f}"),
        ("generated tok/s (generate)", "generate_tokens_per_s", "{:.1f}"),
        ("step s / generated token", "s_per_token", "{:.4f}"),
        ("median rest of step (s)", "median_rest_s", "{:.2f}"),
        ("mean reward", "reward", "{:.3f}"),
        ("zero-variance groups", "zero_variance_fraction", "{:.2f}"),
        ("rollouts trained", "trained_fraction", "{:.2f}"),
    ]
    print(f"\nsteps 2..{args.steps} (step 1 = warm-up, excluded)")
    print(f"{'':28}{'adarl':>10}{'TRL':>10}")
    for label, key, fmt in rows:
        print(f"{label:28}{fmt.format(adarl[key]):>10}{fmt.format(trl_result[key]):>10}")
    print(f"\nratio adarl/TRL median step time: {ratio:.3f}  (target ≤ 0.4)")
    print(f"ratio adarl/TRL step time per generated token: {ratio_per_token:.3f}")
    print(f"same prompts and prompt token ids: {same_prompts}")
    busy = "unknown" if busy_start is None else f"{busy_start:.0%}"
    print(f"CPUs busy before start: {busy}; load average (1, 5, 15 min): {fmt_load(load_start)} at start, "
          f"{fmt_load(load_end)} at end")
    for note in notes:
        print(f"note: {note}")

    if args.out:
        result = {
            "config": {"steps": args.steps, "prompts": args.prompts, "n": args.n,
                       "max_new_tokens": args.max_new_tokens, "threads": threads, **hp},
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__, "trl": trl.__version__},
            "adarl": adarl,
            "trl": trl_result,
            "ratio_step_time": ratio,
            "ratio_step_time_per_token": ratio_per_token,
            "same_prompts": same_prompts,
            "cpu_busy_before_start": busy_start,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "notes": notes,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

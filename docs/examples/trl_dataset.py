"""Turn a TRL-style dataset into an adarl task (`task.source: hf_datasets`), then load it as a run would.

TRL's conversational format has `prompt` as chat messages, the reference answer in its own column
(here `solution`), and extra columns its reward functions take by name (here `level`). This script
builds a small one offline (a real one would come from `load_dataset(...)` on a machine with network,
then `save_to_disk`), saves it with train/test splits, and loads it with the recipe's task section.

    python docs/examples/trl_dataset.py runs/data/arith-trl
"""

import random
import sys

from datasets import Dataset, DatasetDict

from adarl.config import TaskConfig
from adarl.tasks import build_task


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({
            "prompt": [{"role": "user", "content": f"What is {a}+{b}? Reply with only the number."}],
            "solution": str(a + b),
            "level": 1 + (a % 10 + b % 10 >= 10),  # 2 when the ones digits carry
        })
    return out


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/data/arith-trl"
    DatasetDict({"train": Dataset.from_list(rows(200, 0)), "test": Dataset.from_list(rows(50, 1))}).save_to_disk(out)
    cfg = TaskConfig(source="hf_datasets", path=out, split="train", eval_split="test",
                     fields={"answer": "solution"}, system_prompt="You are a concise calculator.")
    task = build_task(cfg)
    print(task)
    first = task.train[0]
    print("prompt: ", first.prompt)
    print("answer: ", first.answer)
    print("columns:", first.columns)

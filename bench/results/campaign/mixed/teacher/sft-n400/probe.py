"""Why on-policy distillation collapses under this SFT teacher: the teacher's minus the base model's log-prob
of the base model's greedy answers to 10 held-out problems (the first token apart from the rest), and how the
teacher continues the base model's first 3 tokens. Its output: probe.txt.

Run from the repository root after `bench/campaign.py --pools mixed --teacher-data /tmp/tdata` and the SFT
(README.txt):  .venv/bin/python bench/results/campaign/mixed/teacher/sft-n400/probe.py
"""

import json
from pathlib import Path

import torch

from adarl.config import ModelConfig
from adarl.models import chat_ids, load_model, load_reference


def logps(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)]


def main() -> None:
    torch.set_num_threads(1)
    student, tok = load_model(ModelConfig(path="smollm2-135m", dtype="float32"))
    teacher = load_reference(ModelConfig(path="runs/teacher-mixed-sft/final"))
    lines = Path("/tmp/tdata/mixed/heldout.jsonl").read_text().splitlines()
    for row in [json.loads(x) for x in lines][::12][:10]:
        prompt = chat_ids(tok, row["prompt"])
        with torch.no_grad():
            out = student.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        out = out.tolist()
        gap = logps(teacher, prompt, out) - logps(student, prompt, out)
        later = float(gap[1:].mean()) if len(out) > 1 else 0.0
        print(repr(row["prompt"][-1]["content"]), row["answer"], "| student:", repr(tok.decode(out))[:50],
              f"| mean gap {float(gap.mean()):.2f}, first-token gap {float(gap[0]):.2f}, later tokens {later:.2f}")
        prefix = prompt + out[:3]
        with torch.no_grad():
            cont = teacher.generate(torch.tensor([prefix]), max_new_tokens=12, do_sample=False)[0, len(prefix):]
        print("    teacher continues the student's first 3 tokens with:", repr(tok.decode(cont.tolist()))[:60])


if __name__ == "__main__":
    main()

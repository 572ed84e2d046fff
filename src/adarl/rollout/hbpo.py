"""HBPO's generation side (algorithms.md §6.1; ZJU-REAL/HBPO): a prompt's n rollouts are split into k
budget subgroups, and each subgroup's answers begin with its budget sentence,

    "I will answer the question within {b} tokens. "      (the code: right after the think tag)

so that the budget-aware reward (`shaping: [{name: hbpo}]`) and advantage (`advantage: {name:
hbpo}`), which read the budget from the text, work without the model volunteering the sentence.
The sentence is inserted, not sampled: a `template` span of the rollout record, never trained,
never counted against the budget (the reward's length n counts sampled tokens only). Subgroups are
as equal as n allows (the first ones get one more). adarl's models have no think tag, so the
sentence opens the answer. This wraps the generator, after the allocator has set n: it composes
with every allocator (the paper's 16 rollouts in 4 subgroups is `allocate: {name: fixed, n: 16}`
with four budgets). Defaults: B = (512, 1024, 2048, 2560).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from adarl.rollout.base import Wrapper
from adarl.types import Request, Rollout, Span

TEMPLATE = "I will answer the question within {b} tokens. "


class BudgetSentences(Wrapper):
    def __init__(self, generator: Any, budgets: Sequence[float] = (512, 1024, 2048, 2560),
                 template: str = TEMPLATE) -> None:
        self.generator, self.budgets, self.template = generator, list(budgets), template
        self.sentences = [list(generator.tokenizer.encode(template.format(b=b), add_special_tokens=False))
                          for b in self.budgets]

    @property
    def unbranched(self) -> Any:
        """The wrapped generator: evaluation asks the question without a budget sentence."""
        return self.generator

    def split(self, n: int) -> list[int]:
        """Rollouts per budget: n over k subgroups, the first n mod k one larger."""
        k = len(self.budgets)
        return [n // k + (i < n % k) for i in range(k)]

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: Any = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        """req.n rollouts per request, consecutive, subgroup by subgroup (budgets in order)."""
        if greedy:  # evaluation asks the question as it is
            return self.generator.generate(requests, greedy=True, max_new_tokens=max_new_tokens)
        parts: list[Request] = []
        sentences: list[list[int]] = []
        for req in requests:
            for ids, m in zip(self.sentences, self.split(req.n), strict=True):
                if m:
                    parts.append(replace(req, prompt_ids=req.prompt_ids + ids, n=m))
                    sentences.append(ids)
        out = self.generator.generate(parts, max_new_tokens=max_new_tokens, stop_when=stop_when, max_tokens=max_tokens)
        rows = iter(out)
        for part, ids in zip(parts, sentences, strict=True):
            for _ in range(part.n):
                r = next(rows)
                r.spans.insert(0, Span("template", list(ids)))
                r.text = self.generator.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        return out

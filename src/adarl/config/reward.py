"""`rewards`: the verifiers that score each completion."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from adarl.config.base import Section


class RewardConfig(Section):
    # environment: an agent's; sql_execution: a text-to-SQL answer's result set (rewards/sql.py)
    type: Literal["short_answer", "math", "format", "callable", "code", "environment", "sql_execution"]
    name: str | None = None  # metric name; defaults to the type (or the function name)
    weight: float = 1.0
    correctness: bool | None = None  # counts as "correct" for pass rates; default: all but format
    # short_answer
    extract: Literal["answer_tag", "boxed", "last_number", "last_line"] = "last_number"
    match: Literal["exact", "numeric"] = "numeric"
    # format
    pattern: str | None = None  # a regex the completion must match (re.search); default: <answer> tags
    # callable: "package.module:function", TRL signature f(prompts, completions, **columns) -> list[float]
    function: str | None = None
    # code: the program runs in the sandbox (adarl.rewards.sandbox) with these limits
    sandbox_timeout_s: float = Field(5.0, gt=0, le=3600)  # wall clock (and CPU) seconds per program
    sandbox_memory_mb: int = Field(512, ge=64, le=1 << 20)  # address space per process

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.type == "callable" and not self.function:
            raise ValueError("a callable reward needs function: 'module:function'")
        return self

"""`task`: where the problems come from (a built-in source or an import path) and the held-out split."""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from adarl.config.base import Section
from adarl.hub import is_hub_id

TASK_SOURCES = ("reasoning_gym", "jsonl", "humaneval", "hf_datasets", "sql", "retrieval", "compute", "text_to_sql")


class MixtureShare(Section):
    """One share of a mixed-difficulty task (task.mixture): `size` training and `eval_size` held-out
    problems from a reasoning-gym generator, labelled `share` (problems carry it in columns["share"])."""

    share: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # e.g. easy; a metric key part
    name: str  # the reasoning-gym generator
    params: dict[str, Any] = {}
    size: int = Field(gt=0, le=10_000_000)
    eval_size: int = Field(ge=0, le=10_000_000)


class TaskConfig(Section):
    # a built-in source, or "package.module:function" returning a list of Problems (or a TaskSource)
    source: str = "reasoning_gym"

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        if source not in TASK_SOURCES and ":" not in source:
            raise ValueError(f"unknown task source {reprlib.repr(source)}: use one of {', '.join(TASK_SOURCES)}, "
                             "or an import path 'package.module:function' returning a list of Problems")
        return source
    # reasoning_gym
    name: str | None = None  # generator name, e.g. basic_arithmetic
    params: dict[str, Any] = {}
    # or a mixed-difficulty pool: shares from different generators (tasks/mixture.py); size and
    # eval_size are then the sums of the shares'
    mixture: list[MixtureShare] | None = None
    size: int = Field(2000, gt=0, le=10_000_000)  # distinct training problems (held-out ones drawn besides)
    # jsonl
    path: str | None = None
    eval_path: str | None = None  # optional separate eval file; otherwise a held-out split
    fields: dict[str, str] = {"id": "id", "prompt": "prompt", "answer": "answer"}
    # the reference answer is the text after the last occurrence of this in the answer field (GSM8K's
    # "...#### 72" gives "72"); a row without it is a bad row. None: the whole field
    answer_after: str | None = Field(None, min_length=1)
    skip_bad_lines: bool = False  # skip (and count) malformed lines instead of stopping
    max_bad_fraction: float = Field(0.1, ge=0.0, le=1.0)  # more bad lines than this is an error
    # untrusted data files (tasks/guard.py): larger files (or a parquet's decompressed data) and larger
    # lines/rows are refused, naming the file
    max_file_mb: float = Field(4096.0, gt=0, le=1_000_000)
    max_row_mb: float = Field(16.0, gt=0, le=1024)
    # hf_datasets: path (and eval_path) is a local data file or folder read with `datasets`, or a Hub dataset
    # id (org/name) read from the Hugging Face cache (adarl.hub); fields and skip_bad_lines as for jsonl
    config: str | None = None  # the subset (a Hub dataset's config, e.g. gsm8k's main); None: the data's only one
    split: str | None = None  # the split to train on (e.g. train); None: the only one there is
    eval_split: str | None = None  # hold out this split of path (at most eval_size) instead of a random split
    # both
    # held-out problems. 400 keeps one pass@1's binomial 95% interval within ±0.05 (n ≥ 385 at p = 0.5).
    # Left unset on a jsonl file or humaneval with fewer than 800 distinct problems, half of them are held
    # out instead; build_task records the number used, so config.yaml (and a resume) holds it.
    eval_size: int = Field(400, ge=0, le=10_000_000)
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"  # {prompt} is the item's question text
    # the problem pool and the held-out split. Not the recipe's `seed`: every training seed of a
    # comparison trains on the same problems and is scored on the same held-out set.
    data_seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="before")
    @classmethod
    def _seed_is_data_seed(cls, data: Any) -> Any:
        """`task.seed` is the old name of `task.data_seed`: accepted, with a warning."""
        if not isinstance(data, dict) or "seed" not in data:
            return data
        import warnings

        data = dict(data)
        seed = data.pop("seed")
        if seed is None:
            return data
        if "data_seed" in data and data["data_seed"] != seed:
            raise ValueError(f"task.seed ({seed}) and task.data_seed ({data['data_seed']}) disagree: task.seed "
                             "is the old name of task.data_seed; keep only task.data_seed")
        warnings.warn(f"task.seed is deprecated: it is now task.data_seed (set task.data_seed: {seed}). The "
                      "recipe's seed no longer decides the problems, only sampling and order", FutureWarning,
                      stacklevel=2)
        data["data_seed"] = seed
        return data

    @model_validator(mode="before")
    @classmethod
    def _mixture_sizes(cls, data: Any) -> Any:
        """With task.mixture, task.size and task.eval_size are the sums of its shares' (given, they must agree)."""
        if not isinstance(data, dict) or not isinstance(data.get("mixture"), list):
            return data
        data = dict(data)
        for key in ("size", "eval_size"):
            values = [m.get(key) if isinstance(m, dict) else getattr(m, key, None) for m in data["mixture"]]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                continue  # the share's own validation names the bad value
            total = sum(values)
            if key in data and data[key] != total:
                raise ValueError(f"task.{key} is {data[key]} but the task.mixture shares' {key}s add up to {total}: "
                                 f"leave task.{key} out (it is their sum) or make them agree")
            data[key] = total
        return data

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.mixture is not None:
            if self.source != "reasoning_gym":
                raise ValueError(f"task.mixture needs task.source 'reasoning_gym' (got {self.source!r})")
            if self.name or self.params:
                raise ValueError("task.mixture names its generators per share: leave task.name and task.params out")
            if not self.mixture:
                raise ValueError("task.mixture is empty: list at least one share {share, name, size, eval_size}")
            labels = [m.share for m in self.mixture]
            if len(set(labels)) != len(labels):
                raise ValueError(f"task.mixture: share labels must differ (got {', '.join(labels)})")
        elif self.source == "reasoning_gym" and not self.name:
            raise ValueError("task.name is required for source 'reasoning_gym' (e.g. basic_arithmetic)")
        if self.source == "jsonl":
            if not self.path:
                raise ValueError("task.path is required for source 'jsonl'")
            for p in (self.path, self.eval_path):
                if p and not Path(p).expanduser().is_file():
                    raise ValueError(f"task file not found: {p}")
        if self.source == "hf_datasets":
            if not self.path:
                raise ValueError("task.path is required for source 'hf_datasets' (a local data file or folder, "
                                 "or a Hub dataset id org/name)")
            for p in (self.path, self.eval_path):
                if p and not Path(p).expanduser().exists() and not is_hub_id(p):
                    raise ValueError(f"task data not found: {p} (source 'hf_datasets' reads a local data file or "
                                     "folder, or a Hub dataset id org/name such as openai/gsm8k)")
        if self.config is not None:
            if self.source != "hf_datasets":
                raise ValueError(f"task.config is the subset of a Hugging Face dataset (source 'hf_datasets'), "
                                 f"not of source '{self.source}'; remove it")
            if not re.fullmatch(r"[\w.+-]+", self.config, re.ASCII) or set(self.config) == {"."}:
                raise ValueError(f"task.config {reprlib.repr(self.config)}: expected a config name such as main "
                                 "(letters, digits, '_', '-', '+', '.')")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain {prompt}")
        return self

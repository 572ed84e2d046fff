"""What every recipe section shares: strict pydantic models, bounds on any value of a recipe."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_RECIPE_VALUES = 100_000  # values in a recipe once YAML aliases are expanded
MAX_RECIPE_DEPTH = 64  # nesting of sections and lists
MAX_SECONDS = 86_400.0  # any timeout: a day
MAX_COUNT = 10_000_000  # any integer parameter of a component (rollouts per prompt, bins, ...)


def _is_count(annotation: Any) -> bool:
    """An int field (or int | None): a YAML boolean there is a mistake, though Python's bool is an int."""
    if annotation is int:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and int in typing.get_args(annotation)


def bool_counts(fields: dict[str, Any], data: Any) -> list[str]:
    """Keys of `data` that hold a boolean where `fields` (name -> annotation) expects an integer."""
    if not isinstance(data, dict):
        return []
    return [k for k, v in data.items() if isinstance(v, bool) and k in fields and _is_count(fields[k])]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_counts(cls, data: Any) -> Any:
        bad = bool_counts({k: f.annotation for k, f in cls.model_fields.items()}, data)
        if bad:
            raise ValueError(f"'{bad[0]}' is a count: expected an integer, got the boolean {data[bad[0]]}")
        return data


TokenCount = Annotated[int, Field(gt=0, le=1_000_000)]  # a number of tokens, in a list

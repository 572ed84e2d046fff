"""Hostile agent environments named in a recipe (rollout.agent.environment "package.module:Class").

The tester found the environment checked only after the model loaded, its module's import-time code
run unbounded in the trainer. Now `api.check_run` (the CLI's `adarl train` and `api.train` both call
it) imports the module in a throwaway supervised worker with a deadline before any model loads: an
import that hangs, exits, is killed or raises is one error naming the environment, and no user code
runs in this process. An import in this process (the agent's own, later) has a deadline too. Time
caps per case: 10 s (a worker's spawn is ~1 s on this machine; the hang case waits its 2 s deadline).
"""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from adarl import api
from adarl.config import RecipeError
from adarl.rollout import tools
from adarl.rollout.tools import environment_class, import_with_deadline, validate_environment
from time_caps import fastest

CAP_S = 10.0
GOOD = """
class Env:
    def reset(self, **row):
        return "ready"

    def add(self, a: int, b: int) -> str:
        '''Add two integers.'''
        return str(a + b)
"""


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    """Write a module of the given source under a fresh name on sys.path (workers inherit it); its name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"hostile_env_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


@pytest.fixture(autouse=True)
def _time_cap():
    start = time.monotonic()
    yield
    assert time.monotonic() - start < CAP_S


@pytest.mark.parametrize(("source", "why"), [
    ("import time\ntime.sleep(1000)\n", r"importing it timed out after 2 s"),
    ("raise RuntimeError('boom at import')\n", r"importing \S+ raised RuntimeError: boom at import"),
    ("import sys\nsys.exit(3)\n", r"importing \S+ raised SystemExit: 3"),
    ("import os\nos._exit(0)\n", r"importing it exited with code 0"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", r"importing it was killed by signal SIGKILL"),
    ("x = [0] * 10\nraise MemoryError('too big')\n", r"raised MemoryError"),
    ("import json\njson.loads('[' * 100000)\n", r"raised RecursionError"),
    ("class Env:\n    pass\n", r"has no reset\(\*\*row\) method"),
    ("Env = 42\n", r"has no reset\(\*\*row\) method"),
    ("", r"cannot be loaded \(AttributeError"),
])
@pytest.mark.heavy
def test_a_hostile_environment_module_is_one_error_naming_it(env_module, source, why):
    name = env_module(source)
    with pytest.raises(ValueError, match=rf"^rollout.agent.environment '{name}:Env'.*{why}"):
        validate_environment(f"{name}:Env", timeout_s=2.0)
    assert name not in sys.modules  # the check ran none of its code here


def test_a_missing_module_is_named():
    with pytest.raises(ValueError, match=r"'no_such_env_module:Env' cannot be loaded \(ModuleNotFoundError"):
        validate_environment("no_such_env_module:Env", timeout_s=5.0)


def test_not_an_import_path_lists_the_built_ins():
    built_ins = r"\(calculator, sql, search, python, text_to_sql\)"
    with pytest.raises(ValueError, match=r"'calculatr': not a built-in " + built_ins):
        validate_environment("calculatr")


@pytest.mark.parametrize("name", ["calculator", "sql", "search", "openenv"])
def test_built_in_environments_pass_without_a_worker(name):
    fastest(lambda: validate_environment(name), 0.1)


def test_a_good_environment_passes_and_is_not_imported_here(env_module):
    name = env_module(GOOD)
    validate_environment(f"{name}:Env", timeout_s=5.0)
    assert name not in sys.modules


def test_an_import_in_this_process_has_a_deadline_too(env_module):
    name = env_module("import time\ntime.sleep(1000)\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^what: importing '{name}' did not finish in 0.5 s"):
        import_with_deadline(name, "what", timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match=r"hung earlier in this process"):  # never the half-imported module
        import_with_deadline(name, "what", timeout_s=0.5)


def test_environment_class_in_process_turns_import_errors_into_one_error(env_module, monkeypatch):
    monkeypatch.setattr(tools, "IMPORT_TIMEOUT_S", 0.5)
    name = env_module("raise KeyError('at import')\n")
    with pytest.raises(ValueError, match=rf"^rollout.agent.environment '{name}:Env': importing '{name}' raised "
                                         r"KeyError: 'at import'"):
        environment_class(f"{name}:Env")
    name = env_module("import sys\nsys.exit(0)\n")  # SystemExit must not end the trainer
    with pytest.raises(ValueError, match=r"raised SystemExit: 0"):
        environment_class(f"{name}:Env")


def test_train_refuses_a_hostile_environment_before_any_model_loads(env_module, tmp_path, monkeypatch):
    name = env_module("raise RuntimeError('import-time code')\n")
    import adarl.train.trainer as trainer_module

    def no_trainer(*args, **kwargs):
        raise AssertionError("the trainer (and its model) must not be built")

    monkeypatch.setattr(trainer_module, "Trainer", no_trainer)
    recipe = {"name": "env-check", "model": {"path": str(tmp_path / "never-loaded")},
              "rollout": {"backend": "hf", "agent": {"environment": f"{name}:Env"}},
              "task": {"source": "reasoning_gym", "name": "basic_arithmetic"}}
    with pytest.raises(RecipeError, match=rf"rollout.agent.environment '{name}:Env': importing '{name}' raised "
                                          r"RuntimeError: import-time code"):
        api.train(recipe, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and name not in sys.modules


def test_check_run_passes_a_good_environment(env_module, tmp_path):
    name = env_module(GOOD)
    recipe = api.load_recipe({"name": "env-ok", "rollout": {"backend": "hf", "agent": {"environment": f"{name}:Env"}},
                              "task": {"source": "reasoning_gym", "name": "basic_arithmetic"}})
    api.check_run(recipe, Path(tmp_path / "run"), resume=False)

"""The table of engines (adarl/engines.py) is the one place an engine is named: every reader agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adarl import engines
from adarl.config import ModelConfig, RolloutConfig, pick_backend
from adarl.engines import ENGINES
from adarl.models import load_model
from adarl.rollout import build_generator
from adarl.rollout.base import CAPABILITIES, Generator, missing_members
from adarl.train.build import missing_packages

SRC = Path(__file__).resolve().parents[2] / "src" / "adarl"


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_row_imports_its_class_with_the_rows_capabilities(name):
    r = ENGINES[name]
    assert set(r.capabilities) <= set(CAPABILITIES), r.capabilities - set(CAPABILITIES)
    if not r.installed():
        pytest.skip(f"{r.package} is not installed")
    cls = r.engine_class()
    assert cls.__name__ == r.path.rpartition(":")[2]
    assert cls.capabilities == r.capabilities  # the class reads its row: one declaration
    assert [m for m in missing_members(cls) if m not in Generator.__annotations__] == []  # the contract's methods


def test_the_recipe_check_accepts_every_row_and_names_them_when_refusing():
    for name in ENGINES:
        assert RolloutConfig(backend=name).backend == name
    with pytest.raises(ValueError, match=r"use auto, vllm, hf, or an engine of your own"):
        RolloutConfig(backend="sglang")
    # a recipe that needs per-token entropies (EPTree) on a row without them: refused, the row that has them named
    with pytest.raises(ValueError, match=r"rollout.branching needs backend: hf \(it records no per-token entropies"):
        RolloutConfig(backend="vllm", branching={"policy": "eptree"})


def test_auto_takes_the_first_installed_row_that_serves_the_recipe(monkeypatch):
    monkeypatch.delenv("ADARL_AUTO_BACKEND", raising=False)
    vllm_here = ENGINES["vllm"].installed()
    assert pick_backend(RolloutConfig()) == ("vllm" if vllm_here else "hf")  # vllm is the table's first row
    # async mode needs `replica`, which only hf declares
    assert pick_backend(RolloutConfig(scheduler={"mode": "async"})) == "hf"
    assert pick_backend(RolloutConfig(), needs_entropy=True) == "hf"
    monkeypatch.setenv("ADARL_AUTO_BACKEND", "hf")
    assert pick_backend(RolloutConfig()) == "hf"


def test_the_install_check_reads_the_rows_package(monkeypatch):
    monkeypatch.setitem(ENGINES, "vllm", engines.EngineRow(
        "vllm", "adarl.rollout.vllm:VllmGenerator", frozenset(), "no_such_package_xyz", "install it thus",
        "here", learner_forward=False))
    assert missing_packages(RolloutConfig(backend="vllm")) == ["install it thus"]
    assert missing_packages(RolloutConfig(backend="hf")) == []


def test_the_builder_and_the_ray_worker_build_the_rows_class(tiny_model_dir):
    from adarl.cluster.ray_pool import RolloutWorker, weights_of
    from adarl.rollout.base import Weights
    from adarl.rollout.weights import weight_delta

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    cfg = RolloutConfig(backend="hf", max_new_tokens=4)
    gen = build_generator(model, tok, cfg)
    assert type(gen) is ENGINES["hf"].engine_class()
    worker = RolloutWorker(model.config, tok, cfg, "hf", threads=1)  # the actor's class, here in-process
    assert worker.load_weights(weight_delta(None, weights_of(Weights.of(model).named())), 3) == 3
    assert type(worker.generator) is ENGINES["hf"].engine_class()
    assert engines.engine_capabilities("hf", "ray") >= {"remote", "entropies", "top2"}


def test_learner_forward_is_a_column():
    assert engines.samples_with_learner_forward("hf")
    assert not engines.samples_with_learner_forward("hf", "ray")  # a worker's own copy, another process
    assert not engines.samples_with_learner_forward("vllm")
    assert not engines.samples_with_learner_forward("package.module:Engine")


def test_no_module_but_the_table_names_an_engine_class_to_build():
    """The engine is named in one place: nothing outside the table imports an engine class to build it."""
    pattern = re.compile(r"import (HfGenerator|VllmGenerator)\b|\b(HfGenerator|VllmGenerator)\(")
    own = {"engines.py", "rollout/hf.py", "rollout/vllm.py"}  # the table, and a class copying itself
    offenders = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
                 if p.relative_to(SRC).as_posix() not in own and pattern.search(p.read_text())]
    assert offenders == []


def test_no_capability_probes_on_generators():
    """Optional abilities are declared (rollout/base.py: CAPABILITIES) and asked with `capable`, never probed."""
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.)?(generator|gen|engine|worker)\b")
    found = [f"{p.relative_to(SRC).as_posix()}:{i}" for p in SRC.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if probe.search(line) and "for m in declared" not in line]  # that one is the contract check
    assert found == []

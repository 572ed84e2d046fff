"""A run directory runs no code (issue 52, item 1): a pickle planted in any file it holds stays inert.

A run directory is shared (a checkpoint to resume, a teacher, a comparison to report), so it is untrusted
input. Each case copies a real one-step tiny run, plants a payload whose unpickling touches a marker file
into a file the run holds (`state.pt`, `optimizer.pt`, a sharded checkpoint's `.metadata` and byte items,
the final model's weights), then reads the run the way adarl does: `checkpoint.load`, `--resume`
(`resume_from_checkpoint` and the CLI), `load_dcp`, `adarl eval`, a teacher and the report. Each must
raise one clear error (or read only what it needs) and the marker must not exist. With
`--trust-checkpoint-pickles` a checkpoint of an older adarl (numpy arrays pickled) still resumes.
"""

from __future__ import annotations

import pathlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from adarl.cli import app
from adarl.config import load_recipe
from adarl.train import checkpoint
from adarl.train.checkpoint import TRUST_ENV, UntrustedCheckpoint
from adarl.train.loop import resume_from_checkpoint, state_of
from adarl.train.trainer import ResumeError, Trainer
from test_train import recipe_data, write_task

TESTS = Path(__file__).resolve().parents[1]
STEP = "step_000001"


class Payload:
    """Unpickled, it creates `marker`: what a crafted checkpoint would do with `os.system` instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished one-step tiny run with its step-1 checkpoint (read-only: tests copy it)."""
    root = tmp_path_factory.mktemp("pickles")
    data = recipe_data(tiny_model_dir, write_task(root), budget={"max_steps": 1, "prompts_per_step": 2},
                       allocate={"name": "fixed", "n": 2}, checkpoint={"every": 1},
                       log={"tensorboard": False, "progress": False})
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTS))
        mp.setenv("PYTHONPATH", str(TESTS))  # the reward workers import e2e_rewards
        Trainer(load_recipe(data=data), root / "run").run()
    assert (root / "run" / "checkpoints" / STEP / "state.pt").is_file()
    return root / "run"


@pytest.fixture
def run(trained_run, tmp_path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setenv(TRUST_ENV, "0")  # whatever the caller's environment says; restored afterwards
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def plant(file: Path, marker: Path) -> None:
    """Put the payload inside `file`'s real content: a leaf of the state, or the optimizer's learning rate."""
    content = torch.load(file, weights_only=True)
    if file.name == "optimizer.pt":
        content["param_groups"][0]["lr"] = Payload(marker)
    else:
        content["budget"]["total_tokens"] = Payload(marker)
    torch.save(content, file)


def one_line_refusal(message: str, file: str) -> None:
    assert "\n" not in message and len(message) < 600, message
    assert file in message and "pickled Python objects" in message and "--trust-checkpoint-pickles" in message


def test_the_planted_payload_runs_under_a_full_unpickler(run, tmp_path):
    # the control: the payload is live, so its marker missing below means the loader never ran it
    marker = tmp_path / "pwned"
    plant(run / "checkpoints" / STEP / "state.pt", marker)
    torch.load(run / "checkpoints" / STEP / "state.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", ["state.pt", "optimizer.pt"])
def test_checkpoint_load_refuses_a_planted_pickle(run, tmp_path, name):
    marker = tmp_path / "pwned"
    plant(run / "checkpoints" / STEP / name, marker)
    model = Trainer(load_recipe(run / "config.yaml"), run).model
    with pytest.raises(UntrustedCheckpoint) as err:
        checkpoint.load(run / "checkpoints" / STEP, model)
    one_line_refusal(str(err.value), name)
    assert "(it names getattr)" in str(err.value)  # what the pickle asked for: torch.save reaches Path.touch so
    assert not marker.exists()


@pytest.mark.parametrize("name", ["state.pt", "optimizer.pt"])
def test_resume_refuses_a_planted_pickle(run, tmp_path, name):
    marker = tmp_path / "pwned"
    plant(run / "checkpoints" / STEP / name, marker)
    trainer = Trainer(load_recipe(run / "config.yaml"), run)
    with pytest.raises(ResumeError) as err:
        resume_from_checkpoint(trainer)
    one_line_refusal(str(err.value), f"{STEP}/{name}")
    assert str(err.value).startswith(f"cannot resume {run} from {STEP}: ")
    assert not marker.exists()


def test_cli_resume_refuses_a_planted_pickle_in_one_line(run, tmp_path):
    marker = tmp_path / "pwned"
    for name in ("state.pt", "optimizer.pt"):
        plant(run / "checkpoints" / STEP / name, marker)
    result = CliRunner().invoke(app, ["train", "--resume", str(run)], env={"COLUMNS": "2000"})
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    one_line_refusal(errors[0], f"{STEP}/state.pt")  # the first file a resume reads, before any weights load
    assert not marker.exists()


@pytest.fixture
def dcp_pair(tmp_path, monkeypatch):
    """A model and optimizer after one AdamW step, a sharded (DCP) checkpoint of them, and a second pair
    that loads it: the legitimate folder loads, weights and learning rate included."""
    monkeypatch.setenv(TRUST_ENV, "0")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    checkpoint.save_dcp(model, optimizer, tmp_path / "sharded")
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.5)
    checkpoint.load_dcp(other, other_optimizer, tmp_path / "sharded")
    assert torch.equal(other.weight, model.weight) and other_optimizer.param_groups[0]["lr"] == 0.1
    return model, optimizer, other, other_optimizer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_metadata_is_not_unpickled(dcp_pair, tmp_path):
    """DCP's own reader unpickles a sharded checkpoint's `.metadata` with `pickle.load`."""
    _, _, other, other_optimizer = dcp_pair
    marker = tmp_path / "pwned"
    metadata = checkpoint.read_dcp_metadata(tmp_path / "sharded" / ".metadata")
    metadata.planner_data = Payload(marker)
    with open(tmp_path / "sharded" / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    with pytest.raises(UntrustedCheckpoint) as err:
        checkpoint.load_dcp(other, other_optimizer, tmp_path / "sharded")
    assert "\n" not in str(err.value) and "sharded/.metadata holds pickled" in str(err.value), err.value
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_byte_items_are_not_unpickled(dcp_pair, tmp_path):
    """DCP's default planner loads byte items (the optimizer's hyperparameters) with weights_only=False."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, other, other_optimizer = dcp_pair
    marker = tmp_path / "pwned"
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp_path / "planted"))
    with pytest.raises(UntrustedCheckpoint) as err:
        checkpoint.load_dcp(other, other_optimizer, tmp_path / "planted")
    assert "\n" not in str(err.value) and "planted holds pickled" in str(err.value), err.value
    assert not marker.exists()


def test_eval_teacher_report_and_compare_read_no_pickle_of_the_run(run, tmp_path):
    """Every `.pt` of the run holds the payload; `adarl eval` of the run, its checkpoint and its final
    model, the run's final model as a teacher, `compare`'s look at the run and the report run none of it."""
    from adarl import evaluate as ev
    from adarl.compare import run_state
    from adarl.config import ModelConfig
    from adarl.models import load_reference
    from adarl.report import write_report

    marker = tmp_path / "pwned"
    planted = sorted(run.rglob("*.pt"))
    assert {p.name for p in planted} == {"state.pt", "optimizer.pt"}
    for file in planted:
        plant(file, marker)
    for spec in (run, run / "checkpoints" / STEP, run / "final"):
        ev.load_target(ev.resolve_target(spec), threads=1)
    load_reference(ModelConfig(path=str(run / "final")))
    assert run_state(run) == "done"
    assert write_report(run).is_file()
    assert not marker.exists()


def test_a_final_model_with_pickled_weights_is_refused(run, tmp_path):
    """final/ with its safetensors swapped for a `pytorch_model.bin` holding the payload: eval and a
    teacher refuse it (transformers loads .bin weights-only) and run nothing."""
    from safetensors.torch import load_file

    from adarl import evaluate as ev
    from adarl.config import ModelConfig
    from adarl.models import load_reference

    marker = tmp_path / "pwned"
    final = run / "final"
    weights = load_file(final / "model.safetensors")
    (final / "model.safetensors").unlink()
    torch.save({**weights, "payload": Payload(marker)}, final / "pytorch_model.bin")
    with pytest.raises(Exception):  # noqa: B017 (transformers' own error)
        ev.load_target(ev.resolve_target(final), threads=1)
    with pytest.raises(Exception):  # noqa: B017
        load_reference(ModelConfig(path=str(final)))
    assert not marker.exists()


def _old_style(run: Path) -> dict:
    """The step-1 checkpoint rewritten as adarl wrote them before issue 52: numpy arrays pickled."""
    path = run / "checkpoints" / STEP
    state = checkpoint.from_plain(torch.load(path / "state.pt", weights_only=True))
    assert any(isinstance(v, np.ndarray) for v in state["store"].values())
    torch.save(state, path / "state.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path / "state.pt", weights_only=True)
    return state


def test_trust_flag_resumes_an_old_style_pickle_checkpoint(run, monkeypatch):
    saved = _old_style(run)
    trainer = Trainer(load_recipe(run / "config.yaml"), run)
    with pytest.raises(ResumeError, match="holds pickled Python objects .*numpy"):
        resume_from_checkpoint(trainer)
    monkeypatch.setenv(TRUST_ENV, "1")
    trainer = Trainer(load_recipe(run / "config.yaml"), run)
    assert resume_from_checkpoint(trainer) and trainer.step == 1
    resumed = state_of(trainer)
    for key in ("store", "budget", "components", "np_rng", "python_rng"):
        np.testing.assert_equal(resumed[key], saved[key], err_msg=key)


def test_cli_trust_flag_resumes_an_old_style_checkpoint(run):
    _old_style(run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["budget"]["max_steps"] == 1  # the resumed run is already at its budget: it only finishes
    refused = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert refused.exit_code == 2 and "--trust-checkpoint-pickles" in refused.output, refused.output
    result = CliRunner().invoke(app, ["train", "--resume", str(run), "--trust-checkpoint-pickles"])
    assert result.exit_code == 0, result.output
    assert f"continuing {run} from step 1" in result.output


def test_a_model_folder_asking_for_its_own_code_is_refused_without_a_prompt(trained_run, tmp_path, monkeypatch):
    """issue 52 item 4: a run's final/ whose config names custom code (`auto_map`, a model type transformers
    does not know): adarl passes `trust_remote_code=False`, so transformers neither prompts on stdin nor
    imports the folder's module; the load is an error."""
    import builtins
    import json

    from adarl.config import ModelConfig
    from adarl.models import load_model

    marker = tmp_path / "pwned"
    folder = Path(shutil.copytree(trained_run / "final", tmp_path / "custom"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom_llama", auto_map={"AutoConfig": "custom.Config",
                                                       "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    asked: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(ModelConfig(path=str(folder)), for_training=False)
    assert not asked and not marker.exists()

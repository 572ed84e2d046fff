"""Hub ids for model.path and an hf_datasets task.path, resolved through a Hugging Face cache the test builds.

Every cache here is written by the test (``models--org--name/snapshots/<hash>/...`` and ``refs/main``,
as huggingface_hub lays it out) under tmp_path, which is HF_HUB_CACHE. A guard records any attempt to
resolve a host name or open a socket, so a test that would reach the network fails instead.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import pytest
import torch

from adarl import hub
from adarl.config import ModelConfig, TaskConfig
from adarl.models import load_model, resolve_model
from adarl.tasks import build_task

MODEL_ID = "tiny-org/tiny-chat"
DATASET_ID = "openai/gsm8k"

# GSM8K's columns and layout on the Hub: main/{train,test}-00000-of-00001.parquet and socratic/...
MAIN_TRAIN = [{"question": f"Tom has {k} apples and buys {k} more. How many now?",
               "answer": f"He has {k} + {k} = <<{k}+{k}={2 * k}>>{2 * k} apples.\n#### {2 * k}"} for k in (1, 2, 3)]
MAIN_TEST = [{"question": "What is 10 times 10?", "answer": "10 * 10 = 100\n#### 100"},
             {"question": "Ann has 1,200 pens and gives away 200. How many are left?",
              "answer": "1,200 - 200 = 1,000\n#### 1,000"}]
SOCRATIC_TRAIN = [{"question": "How many legs do 3 cats have?",
                   "answer": "How many legs? ** 3 * 4 = 12\n#### 12"}]


def cache_repo(cache: Path, repo_id: str, repo_type: str, files: dict[str, Path | list[dict] | str]) -> Path:
    """Write `repo_id` into the hub cache `cache` as huggingface_hub does; returns its snapshot folder.

    A value is a file or folder to copy, rows to write as parquet, or text."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40-hex commit hash
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, value in files.items():
        dest = snapshot / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, Path):
            (shutil.copytree if value.is_dir() else shutil.copy)(value, dest)
        elif isinstance(value, list):
            import datasets

            datasets.Dataset.from_list(value).to_parquet(str(dest))
        else:
            dest.write_text(value)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def cache_gsm8k(cache: Path) -> Path:
    return cache_repo(cache, DATASET_ID, "dataset", {"main/train-00000-of-00001.parquet": MAIN_TRAIN,
                                                     "main/test-00000-of-00001.parquet": MAIN_TEST,
                                                     "socratic/train-00000-of-00001.parquet": SOCRATIC_TRAIN})


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache as HF_HUB_CACHE, offline."""
    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return path


@pytest.fixture
def network_calls(monkeypatch) -> list[str]:
    """Every host lookup or socket connection attempted while the test runs (each one also fails)."""
    calls: list[str] = []

    def refuse(what):
        def fail(*args, **kwargs):
            calls.append(f"{what}{args[:2]}")
            raise OSError(f"test: no network ({what})")
        return fail

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    return calls


# ---------------------------------------------------------------- models


def test_a_cached_hub_model_loads_offline_like_a_local_folder(cache, tiny_model_dir, network_calls):
    snapshot = cache_repo(cache, MODEL_ID, "model", {".": tiny_model_dir})
    assert resolve_model(MODEL_ID) == (snapshot, None)
    model, tok = load_model(ModelConfig(path=MODEL_ID, device="cpu"), for_training=False)
    local, _ = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu"), for_training=False)
    assert tok.decode(tok.encode("What is 2+2?")) == "What is 2+2?"
    for (name, a), (_, b) in zip(model.state_dict().items(), local.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert network_calls == []


def test_a_cached_snapshot_is_used_online_without_a_network_call(cache, tiny_model_dir, network_calls,
                                                                 monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at its import
    snapshot = cache_repo(cache, MODEL_ID, "model", {".": tiny_model_dir})
    assert resolve_model(MODEL_ID) == (snapshot, None)
    cache_gsm8k(cache)
    task = build_task(TaskConfig(source="hf_datasets", path=DATASET_ID, config="main", split="train",
                                 eval_split="test", fields={"prompt": "question"}))
    assert len(task.train) == 3
    # huggingface_hub falls back to the cache when a request fails, so only the guard can tell
    assert network_calls == []


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.cache_dir() == tmp_path / "hf-home" / "hub"
    snapshot = cache_repo(tmp_path / "hf-home" / "hub", MODEL_ID, "model", {".": tiny_model_dir})
    assert resolve_model(MODEL_ID) == (snapshot, None)


@pytest.mark.parametrize("offline", ["1", "TRUE"])
def test_an_uncached_model_offline_is_one_clear_error(cache, network_calls, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("Qwen/Qwen2.5-1.5B-Instruct")
    message = str(err.value)
    assert message.startswith("model.path 'Qwen/Qwen2.5-1.5B-Instruct': this Hub model is not in the Hugging "
                              f"Face cache ({cache}) and HF_HUB_OFFLINE is set")
    assert "`hf download Qwen/Qwen2.5-1.5B-Instruct`" in message and "unset HF_HUB_OFFLINE" in message
    assert network_calls == []


def test_an_uncached_model_online_is_downloaded_into_the_cache(cache, tiny_model_dir, monkeypatch):
    """huggingface_hub's snapshot_download stands in for the Hub: the first call (cache only) finds
    nothing, the second downloads into the cache it was given."""
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, *, repo_type, cache_dir, local_files_only=False):
        calls.append((repo_id, repo_type, Path(cache_dir), local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(cache_repo(Path(cache_dir), repo_id, repo_type, {".": tiny_model_dir}))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    folder, _ = resolve_model(MODEL_ID)
    assert calls == [(MODEL_ID, "model", cache, True), (MODEL_ID, "model", cache, False)]
    assert (folder / "config.json").is_file() and folder.is_relative_to(cache)


def test_a_failed_download_is_one_clear_error(cache, monkeypatch):
    import huggingface_hub

    def fake_snapshot_download(repo_id, *, repo_type, cache_dir, local_files_only=False):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise ConnectionError("Name or service not known\nmore detail")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(FileNotFoundError, match=(
            rf"model.path 'Qwen/Qwen2.5-0.5B-Instruct': this Hub model is not in the Hugging Face cache "
            rf"\({cache}\) and downloading it failed \(ConnectionError: Name or service not known\); check the id "
            r"and the network .*`hf download Qwen/Qwen2.5-0.5B-Instruct`")):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_snapshot_that_is_not_a_transformers_model_says_so(cache):
    cache_repo(cache, MODEL_ID, "model", {"README.md": "no weights here"})
    with pytest.raises(FileNotFoundError, match=f"model.path '{MODEL_ID}': its snapshot .* has no config.json"):
        resolve_model(MODEL_ID)


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and hub.is_hub_id("openai/gsm8k")
    for not_an_id in ("gsm8k", "./org/name", "/abs/path", "a/b/c", "org/..", "~/models", "org/name with space"):
        assert not hub.is_hub_id(not_an_id), not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)  # an existing local path wins over the Hub
    assert not hub.is_hub_id("org/name")


# ---------------------------------------------------------------- datasets


def gsm8k_task(**kw) -> TaskConfig:
    base = {"source": "hf_datasets", "path": DATASET_ID, "config": "main", "split": "train", "eval_split": "test",
            "fields": {"prompt": "question"}, "answer_after": "####"}
    return TaskConfig(**{**base, **kw})


def test_a_cached_hub_dataset_loads_the_rows_of_its_config_and_split(cache, network_calls):
    cache_gsm8k(cache)
    task = build_task(gsm8k_task())
    assert task.name == "gsm8k"
    assert sorted(p.columns["question"] for p in task.train) == sorted(r["question"] for r in MAIN_TRAIN)
    assert [p.columns["question"] for p in task.eval] == [r["question"] for r in MAIN_TEST]
    # answer_after keeps the text after the last "####": k + k for k = 1, 2, 3; 100 and "1,000" in test
    assert sorted(p.answer for p in task.train) == ["2", "4", "6"]
    assert [p.answer for p in task.eval] == ["100", "1,000"]
    socratic = build_task(gsm8k_task(config="socratic", eval_split=None, eval_size=0))
    assert [p.answer for p in socratic.train] == ["12"]
    assert network_calls == []


def test_a_config_declared_in_the_readme_is_read_by_datasets(cache):
    readme = ("---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n    path: data/easy-*.parquet\n"
              "- config_name: hard\n  data_files:\n  - split: train\n    path: data/hard-*.parquet\n---\n")
    cache_repo(cache, "org/levels", "dataset", {
        "README.md": readme, "data/easy-00000-of-00001.parquet": MAIN_TRAIN,
        "data/hard-00000-of-00001.parquet": MAIN_TEST})
    task = build_task(TaskConfig(source="hf_datasets", path="org/levels", config="hard", split="train",
                                 fields={"prompt": "question"}, answer_after="####", eval_size=1))
    assert sorted(p.answer for p in task.train + task.eval) == ["1,000", "100"]


def test_an_unknown_config_lists_the_subfolders(cache):
    cache_gsm8k(cache)
    with pytest.raises(ValueError, match=r"task.config 'mian' is neither a subfolder of .* nor a config its README "
                                         r"declares; its subfolders: main, socratic"):
        build_task(gsm8k_task(config="mian"))


def test_an_uncached_dataset_offline_is_one_clear_error(cache, network_calls):
    with pytest.raises(ValueError) as err:
        build_task(gsm8k_task())
    assert str(err.value).startswith(f"task.path 'openai/gsm8k': this Hub dataset is not in the Hugging Face "
                                     f"cache ({cache}) and HF_HUB_OFFLINE is set")
    assert "`hf download openai/gsm8k --repo-type dataset`" in str(err.value)
    assert network_calls == []


def test_a_row_without_the_answer_marker_is_a_bad_row(cache):
    rows = [*MAIN_TRAIN, {"question": "What is 1+1?", "answer": "2"}]
    cache_repo(cache, DATASET_ID, "dataset", {"main/train-00000-of-00001.parquet": rows,
                                              "main/test-00000-of-00001.parquet": MAIN_TEST})
    with pytest.raises(ValueError, match=r"row 4: answer field 'answer' has no '####' \(task.answer_after\)"):
        build_task(gsm8k_task())
    task = build_task(gsm8k_task(skip_bad_lines=True, max_bad_fraction=0.5))
    assert task.skipped == 1 and len(task.train) == 3


def test_the_task_config_accepts_a_hub_id_and_checks_config():
    TaskConfig(source="hf_datasets", path=DATASET_ID, config="main")  # resolved when the task loads, not here
    with pytest.raises(ValueError, match="task data not found: ./openai/gsm8k .*or a Hub dataset id org/name"):
        TaskConfig(source="hf_datasets", path="./openai/gsm8k")
    with pytest.raises(ValueError, match="task.config is the subset of a Hugging Face dataset"):
        TaskConfig(source="reasoning_gym", name="basic_arithmetic", config="main")
    for bad in ("main/train", "..", ""):
        with pytest.raises(ValueError, match="task.config"):
            TaskConfig(source="hf_datasets", path=DATASET_ID, config=bad)
    with pytest.raises(ValueError, match="answer_after"):
        TaskConfig(source="hf_datasets", path=DATASET_ID, answer_after="")

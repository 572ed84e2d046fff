"""Shared test fixtures: a tiny local Llama model with a character-level ChatML tokenizer.

`make_tiny_model_dir(path)` writes a complete HF folder (config, safetensors, generation config,
tokenizer with chat template) that `adarl.models.load_model` loads like any local model; the
session fixture `tiny_model_dir` builds one per test session. Other tests can import the
function (`from conftest import make_tiny_model_dir`) to build variants.

The layout (docs/contributing.md): the tests live in folders that mirror the stages (config/, tasks/,
rewards/, rollout/, agents/, select_allocate/, objectives/, train/, cluster/, metrics/, models/) plus
e2e/, hostile/, benchmarks/ and packaging_docs/; this folder keeps only the helpers that recipes, reward
workers and subprocesses import by name (e2e_rewards, reward_fns, hostile_rewards, ...: `TESTS` on their
PYTHONPATH). Every folder is put on sys.path here, so a test imports another by its basename
(`from test_train import recipe_data`) wherever either lives; basenames stay unique.

Markers: `slow` touches the real SmolLM2 model; `model` builds a model (the tiny one or SmolLM2); `heavy`
starts processes and waits on them (sandboxes, reward worker pools, Ray, Chromium, wandb, a wheel or docs
build). A test gets `model` automatically when it uses a fixture in `MODEL_FIXTURES` (directly or through
another fixture) or is `slow`; a test that builds a model otherwise, or is heavy, says so
(`pytestmark = pytest.mark.heavy` for a file, `@pytest.mark.model` for a test). `make test-fast` leaves all
three out (the formulas, config, parsers, tasks and hostile inputs stay); `make test` runs everything.

`make test` runs two pytest-xdist workers: each takes a whole file, or a group of files sharing a resource
(`SHARED_GROUPS`), or one test of a `SPLIT_FILES` file, the longest first (`LONGEST_FIRST`); each runs torch on
one thread. A test that starts `python -m adarl.cli ...` or a bench script many times uses the session fixture
`warm_python` (tests/warm_python.py: forked from a warm parent). After each module, processes the module left
running are ended with a warning, and os.environ and torch's threads are put back. The budget and how to stay
in it: docs/contributing.md.
"""

from __future__ import annotations

import os
import string
import sys
from pathlib import Path

import pytest

#: the tests' root (this folder) and the repository
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for _folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

#: fixtures that build a model: a test using one (even through another fixture) is marked `model`
MODEL_FIXTURES = frozenset({"tiny_model_dir", "fence_model_dir"})

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM is in the default install, so `rollout.backend: auto` would start an engine in every trainer test;
# tests of the vllm backend name it (tests/rollout/test_vllm.py, which also tests `auto` without this setting)
os.environ.setdefault("ADARL_AUTO_BACKEND", "hf")
# OpenMP threads sleep when idle instead of spinning: with two test workers (or a test and the processes it
# starts) on 2 cores, spinning threads starve the other side several-fold (platform.md). Set before torch loads,
# and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one core per worker (`make test` runs 2): torch's default would take both
    os.environ.setdefault("OMP_NUM_THREADS", "1")

#: characters the tiny tokenizer knows, one token each
TINY_CHARS = string.digits + string.ascii_letters + " \n" + "+-*/=?.,!:;()'\"<>{}[]_#%&$^|@~\\"
TINY_SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_tokenizer(vocab_chars: str = TINY_CHARS):
    """A character-level tokenizer: one token per character, ChatML markers as single tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*TINY_SPECIALS, *dict.fromkeys(vocab_chars)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(TINY_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE, padding_side="left",
    )


def make_tiny_model_dir(path: str | Path, vocab_chars: str = TINY_CHARS, seed: int = 0,
                        num_layers: int = 2, hidden: int = 64) -> Path:
    """Write a tiny random Llama (head_dim 64, tied embeddings) and its tokenizer to `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(vocab_chars)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64), head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=eos, rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def isolate_trackers(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's caches and settings under `home`, never the user's; no MLflow store from the environment."""
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def hide_package(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make `importlib.util.find_spec(name)` answer None for this test, as if `name` were not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))


@pytest.fixture(scope="session")
def warm_python():
    """`python -m` runs forked from one warm parent (tests/warm_python.py): for tests that start many processes."""
    from warm_python import WarmPython

    server = WarmPython()
    yield server
    server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny local HF model folder, built once per session (treat it as read-only)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


#: test files that share a resource run on one `make test` worker, one after another: the Ray tests each start
#: a private cluster (and one checks what listens), so never two at once
SHARED_GROUPS = {"ray": ("cluster/test_ray_pool.py", "cluster/test_ray_learners.py", "cluster/test_cluster_exposure.py",
                         "hostile/test_swarm_hostile.py", "metrics/test_compare.py",
                         "cluster/test_ray_doc_commands.py")}
#: files whose tests share no module fixture and each run for long: spread over the workers test by test
SPLIT_FILES = ("benchmarks/test_bench_smoke.py", "benchmarks/test_bench.py", "train/test_resume_components.py",
               "packaging_docs/test_doc_commands.py")
#: the longest groups first (bench/results/test_profile/), so that no worker is left running one alone at the end
LONGEST_FIRST = ("e2e/test_real_model.py", "ray", "train/test_sharded.py", "models/test_device.py",
                 "train/test_crash.py", "benchmarks/test_bench_smoke.py", "rollout/test_vllm.py",
                 "train/test_resume_components.py", "benchmarks/test_bench.py")


def _group(nodeid: str) -> str:
    """The unit a `make test` worker takes whole: the test's file (its module fixtures are built once), the
    group of files sharing a resource, or, for a SPLIT_FILES file, the test alone."""
    file = nodeid.split("::")[0].removeprefix("tests/")
    for name, files in SHARED_GROUPS.items():
        if file in files:
            return name
    return nodeid if file in SPLIT_FILES else file


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` with the groups above (xdist's own reads `xdist_group` marks from node ids, which
    pytest 9 no longer lets a plugin change): each worker takes one group at a time, in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `model` every test that uses a model-building fixture or is `slow` (see the module docstring);
    under xdist, put the longest groups first (run with --no-loadscope-reorder, xdist keeps this order)."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.model)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

        def first(item: pytest.Item) -> int:
            group = _group(item.nodeid)
            return rank.get(group, rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))

        items.sort(key=first)  # stable: the order inside a file is kept


# ---------------------------------------------------------------- processes a test module leaves running

#: every process a test starts inherits this (a fresh env, as some hostile tests build, does not: those
#: processes are the test's own to end); the module check below ends what is still running after the module
OWNER = "ADARL_TEST_OWNER"
os.environ[OWNER] = str(os.getpid())  # each xdist worker its own, so one never ends the other's processes
#: long-lived helpers that a process starts once for its life and ends at its exit (ending them early only
#: makes it start another, or fail at exit: wandb's service)
_KEEP = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "wandb-core")


def _owned_processes() -> dict:
    """Processes carrying this process's OWNER mark (children, or orphans of a killed child), but not itself."""
    import psutil

    mark = f"{OWNER}={os.getpid()}".encode()
    found = {}
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                owned = mark + b"\0" in f.read() + b"\0"
        except OSError:
            continue
        if owned and not any(k in " ".join(proc.info["cmdline"] or ()) for k in _KEEP):
            found[proc.pid] = proc
    return found


@pytest.fixture(autouse=True, scope="module")
def _restore_process_state():
    """After a test module, undo what it changed in this process for the modules after it: `os.environ`, and
    torch's thread count and `torch.set_num_threads` itself.

    vLLM's in-process engine (tests/rollout/test_vllm.py) adds LD_PRELOAD and a dozen variables to os.environ,
    which every process started later would inherit, and replaces `torch.set_num_threads` with a no-op for the
    rest of the process; a recipe's `model.threads` sets the count for the whole process. Measured in
    bench/results/test_profile/ (no cost found, but a later test should see the suite's state, not its luck).
    """
    env = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.set_num_threads is not torch._C.set_num_threads:
            torch.set_num_threads = torch._C.set_num_threads
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _end_leftover_processes(request: pytest.FixtureRequest):
    """After a test module (its fixtures torn down), end the processes it left running, and say so.

    A busy process left running (a Ray daemon orphaned by a killed run, a worker pool never closed) would take
    CPU from every later test on 2 cores; the whole-suite profile of issue 48 found only idle ones
    (bench/results/test_profile/), and this keeps it so. The warning names the module.
    """
    import warnings

    import psutil

    before = set(_owned_processes())
    yield
    left = [p for pid, p in _owned_processes().items() if pid not in before]
    if not left:
        return
    _, alive = psutil.wait_procs(left, timeout=3)  # a pool shutting down on its own gets a moment
    if not alive:
        return
    names = []
    for proc in alive:
        try:
            names.append(f"{proc.pid} {' '.join(proc.cmdline()).strip()[:120]} ({sum(proc.cpu_times()[:2]):.1f} s CPU)")
            proc.kill()
        except psutil.Error:
            pass
    warnings.warn(f"{request.node.nodeid} left {len(alive)} processes running, ended now: " + "; ".join(names),
                  pytest.PytestWarning, stacklevel=1)

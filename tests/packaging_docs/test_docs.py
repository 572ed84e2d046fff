"""The docs site builds in strict mode, and the commands its getting-started and recipes pages show run.

`mkdocs build --strict` fails on a broken link or anchor (repository files included: docs/hooks.py), a
page outside the navigation or an API reference that does not resolve. Skipped where MkDocs is not
installed (it is in the `dev` and `docs` extras).

A code block marked by a `<!-- test -->` line just above it is run here, on the CPU, in a copy of the
repository's recipes where a tiny local model stands in for SmolLM2 and the sizes are cut to a few
prompts (`stand_in_recipes`); everything else is the recipe's own, and the command is the page's. Blocks:
- `bash`: every line is run (bash -e); the block must exit 0;
- `console`: `$ ` lines are commands; the lines after one are output that must appear in what it prints;
- `python`: run in this process, in the copy's folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TESTED_PAGES = ["getting-started/cpu.md", "getting-started/gpu.md", "getting-started/cluster.md", "recipes.md"]
MARKER = "<!-- test -->"
BLOCK = re.compile(r"^" + re.escape(MARKER) + r"\n```(\w+)\n(.*?)\n```", re.M | re.S)


def marked_blocks() -> list[tuple[str, int, str, str]]:
    out = []
    for page in TESTED_PAGES:
        text = (ROOT / "docs" / page).read_text()
        assert text.count(MARKER) == len(BLOCK.findall(text)), f"{page}: a {MARKER} line not right above a fence"
        out += [(page, i, lang, code) for i, (lang, code) in enumerate(BLOCK.findall(text))]
    return out


BLOCKS = marked_blocks()


@pytest.mark.heavy
def test_the_docs_build_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('id="adarl.api.train"') == 1
    # what the site shows, not what the markdown says: no table cell prints an escaping backslash
    cells = [cell for page in sorted((tmp_path / "site").rglob("*.html"))
             for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", page.read_text(), re.S) if "\\|" in cell]
    assert not cells, cells[:5]


def test_the_tested_pages_mark_a_handful_of_blocks():
    assert 4 <= len(BLOCKS) <= 10, [b[:3] for b in BLOCKS]
    assert {lang for _, _, lang, _ in BLOCKS} <= {"bash", "console", "python"}


def stand_in_recipes(folder: Path, model_dir: Path) -> None:
    """recipes/ copied into `folder` with the tiny model, the hf backend and test sizes; docs/examples too."""
    (folder / "recipes").mkdir(parents=True)
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        data["model"] = {**data.get("model", {}), "path": str(model_dir), "device": "cpu", "threads": 1}
        data["rollout"] = {**data.get("rollout", {}), "backend": "hf", "max_new_tokens": 8}
        data["rollout"].pop("vllm", None)
        if data["task"].get("source") in ("reasoning_gym", "sql", "retrieval"):
            data["task"]["size"] = 16
        data["task"]["eval_size"] = 4
        data["budget"] = {**data.get("budget", {}), "prompts_per_step": 2}
        if "n" in data.get("allocate", {}):
            data["allocate"]["n"] = 4
        data["train"] = {**data.get("train", {}), "micro_batch_tokens": 512}
        data["reward_workers"] = 1
        data["log"] = {"trackers": [], "progress": False}
        (folder / "recipes" / path.name).write_text(yaml.safe_dump(data, sort_keys=False))
    shutil.copytree(ROOT / "docs" / "examples", folder / "docs" / "examples")
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "adarl").write_text(f"#!/bin/sh\nexec {sys.executable} -m adarl.cli \"$@\"\n")
    (bin_dir / "adarl").chmod(0o755)


def shell_env(folder: Path) -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": src + (os.pathsep + path if path else ""), "ADARL_AUTO_BACKEND": "hf"}


@pytest.mark.parametrize("page,index,lang,code", BLOCKS, ids=[f"{p}#{i}" for p, i, _, _ in BLOCKS])
def test_a_marked_block_runs(page, index, lang, code, tiny_model_dir, tmp_path, monkeypatch):
    stand_in_recipes(tmp_path, tiny_model_dir)
    env = shell_env(tmp_path)
    if lang == "bash":
        done = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{page} block {index}:\n{code}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    elif lang == "console":
        for command, expected in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*\n?)*)", code, re.M):
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            printed = done.stdout + done.stderr
            for line in expected.strip().splitlines():
                assert line.strip() in printed, f"{page}: `{command}` did not print {line!r}; it printed:\n{printed}"
    else:
        monkeypatch.chdir(tmp_path)
        exec(compile(code, f"{page}#{index}", "exec"), {"__name__": "__docs__"})

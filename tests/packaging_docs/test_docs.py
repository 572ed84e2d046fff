"""The docs site builds in strict mode, and the Python its getting-started pages show runs.

`mkdocs build --strict` fails on a broken link or anchor (repository files included: docs/hooks.py), a
page outside the navigation or an API reference that does not resolve. Skipped where MkDocs is not
installed (it is in the `dev` and `docs` extras).

A `python` block marked by a `<!-- test -->` line just above it is run here, in this process, on the CPU, in a
folder holding the repository's recipes with a tiny local model standing in for SmolLM2 and the sizes cut to a
few prompts (tests/config/stand_in.py). The shell commands of every page: test_doc_commands.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stand_in import stand_in_recipes

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


def test_the_tested_pages_mark_their_python():
    assert 1 <= len(BLOCKS) <= 10 and {lang for _, _, lang, _ in BLOCKS} == {"python"}, [b[:3] for b in BLOCKS]


@pytest.mark.parametrize("page,index,lang,code", BLOCKS, ids=[f"{p}#{i}" for p, i, _, _ in BLOCKS])
def test_a_marked_block_runs(page, index, lang, code, tiny_model_dir, tmp_path, monkeypatch):
    stand_in_recipes(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page}#{index}", "exec"), {"__name__": "__docs__"})

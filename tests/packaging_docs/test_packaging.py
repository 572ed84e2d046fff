"""adarl as a package: `adarl --version`, built-in recipes by name, and a wheel that ships them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from adarl import __version__
from adarl.config import RecipeError, builtin_recipe, builtin_recipes, load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_printed():
    from typer.testing import CliRunner

    from adarl.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"adarl {__version__}"


def test_a_built_in_recipe_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    assert set(builtin_recipes()) == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert load_recipe("quickstart").name == "quickstart"
    assert load_recipe("quickstart.yaml", ["budget.max_steps=3"]).budget.max_steps == 3
    assert builtin_recipe("../quickstart") is None and builtin_recipe("recipes/quickstart") is None
    with pytest.raises(RecipeError, match="built-in recipes: .*quickstart"):
        load_recipe("quickstrat")


def test_a_file_beats_a_built_in_recipe_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text((ROOT / "recipes" / "quickstart.yaml").read_text()
                                         .replace("name: quickstart", "name: mine"))
    assert load_recipe("quickstart").name == "mine"


def _source_copy(src: Path) -> None:
    """The tracked package files (src/, recipes/, pyproject.toml, README.md) copied to `src`, links kept."""
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True, text=True).stdout.splitlines()
    for rel in tracked:
        path = ROOT / rel
        if path.is_symlink():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).symlink_to(path.readlink())
        elif path.is_file() and (rel.startswith(("src/", "recipes/")) or rel in ("pyproject.toml", "README.md")):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(path.read_bytes())


@pytest.mark.heavy
def test_the_wheel_ships_the_recipes(tmp_path):
    """pip builds the wheel from a copy of the source (no build isolation: setuptools is installed)."""
    src = tmp_path / "src"
    _source_copy(src)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("adarl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).stem for n in names if n.startswith("adarl/recipes/") and n.endswith(".yaml")}
    assert shipped == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert "adarl/cli.py" in names and any(n.endswith("entry_points.txt") for n in names)
    corpus = ROOT / "src" / "adarl" / "data" / "text_to_sql"  # task.source: text_to_sql reads it from the package
    assert {f"adarl/data/text_to_sql/{p.name}" for p in corpus.iterdir()} <= set(names)


@pytest.mark.heavy
def test_the_sdist_ships_the_recipes_and_the_package(tmp_path):
    """setuptools' own build backend makes the sdist; the recipes travel as files (the link is followed)."""
    import tarfile

    src = tmp_path / "src"
    _source_copy(src)
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
                          cwd=src, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("adarl-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    shipped = {Path(n).stem for n in names if "/src/adarl/recipes/" in n and n.endswith(".yaml")}
    assert shipped == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    assert any(n.endswith("src/adarl/cli.py") for n in names) and any(n.endswith("pyproject.toml") for n in names)
    assert any(n.endswith("src/adarl/data/text_to_sql/questions.jsonl") for n in names)

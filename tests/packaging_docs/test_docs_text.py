"""What the pages say, read without building the site: tables render as written, sample recipes are the shipped ones.

A table cell is rendered twice: by Python-Markdown with mkdocs.yml's extensions (the site) and by a GFM table
parser (GitHub, where a newcomer reads README.md and docs/). The two disagree on `\\|` inside a code span: the
site prints the backslash, GitHub needs it (a bare `|` there splits the cell and leaves stray backticks). A cell
must read the same in both: no literal `\\|`, no stray backtick.

A ```yaml block of a page that says `name: <a shipped recipe>` is that recipe as shown: every key it writes has
the shipped recipe's value (a key the recipe leaves out has the config's default). A sample may leave keys out.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import markdown
import pytest
import yaml
from markdown_it import MarkdownIt

from adarl.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
CELL = re.compile(r"<t([dh])[^>]*>(.*?)</t\1>", re.S)
YAML_BLOCK = re.compile(r"^```yaml\n(.*?)\n```", re.M | re.S)


def site_renderer() -> markdown.Markdown:
    """Python-Markdown with the extensions and options mkdocs.yml gives it."""
    names, configs = [], {}
    for ext in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["markdown_extensions"]:
        name, config = next(iter(ext.items())) if isinstance(ext, dict) else (ext, {})
        names.append(name)
        configs[name] = config or {}
    return markdown.Markdown(extensions=names, extension_configs=configs)


def text_of(fragment: str) -> str:
    """What a reader sees: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


def unreadable(text: str, render: Callable[[str], str]) -> list[str]:
    """Cells that show `\\|`, or a backtick outside code (a code span cut in two)."""
    bodies = [body for _, body in CELL.findall(render(text))]
    return [text_of(body) for body in bodies
            if "\\|" in text_of(body) or "`" in text_of(re.sub(r"<code>.*?</code>", "", body, flags=re.S))]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT / "docs").as_posix() for p in PAGES])
def test_a_table_cell_reads_the_same_on_the_site_and_on_github(page):
    text = page.read_text()
    site = site_renderer()
    github = MarkdownIt("commonmark").enable("table")
    assert not unreadable(text, lambda t: site.reset().convert(t)), f"{page.name} on the site"
    assert not unreadable(text, github.render), f"{page.name} on GitHub"


def test_the_readme_tables_read_right_on_github():
    assert not unreadable((ROOT / "README.md").read_text(), MarkdownIt("commonmark").enable("table").render)


def test_the_check_sees_a_backslash_the_site_prints_and_a_cell_github_splits():
    table = "| a | b |\n| --- | --- |\n| `metric: acc\\|reward` | x |\n"
    assert unreadable(table, site_renderer().convert) == ["metric: acc\\|reward"]
    assert not unreadable(table, MarkdownIt("commonmark").enable("table").render)
    split = table.replace("\\|", "|")
    assert not unreadable(split, site_renderer().convert)
    assert unreadable(split, MarkdownIt("commonmark").enable("table").render) == ["`metric: acc", "reward`"]


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 1e-05, ...}: mappings flattened to dotted keys; lists and scalars are leaves."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resolved(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value.model_dump() if hasattr(value, "model_dump") else value


def sample_recipes() -> list[tuple[str, str, dict[str, Any]]]:
    shipped = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    out = []
    for page in [*PAGES, ROOT / "README.md"]:
        for block in YAML_BLOCK.findall(page.read_text()):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data.get("name") in shipped:
                out.append((page.relative_to(ROOT).as_posix(), data["name"], data))
    return out


SAMPLES = sample_recipes()


def disagreements(sample: dict[str, Any], name: str) -> list[str]:
    path = ROOT / "recipes" / f"{name}.yaml"
    written = leaves(yaml.safe_load(path.read_text()))
    config = load_recipe(str(path))
    out = []
    for key, value in leaves(sample).items():
        expected = written[key] if key in written else resolved(config, key)
        if value != expected:
            out.append(f"{key}: {value!r} in the page, {expected!r} in recipes/{name}.yaml")
    return out


def test_the_pages_show_a_shipped_recipe():
    assert ("docs/getting-started/cpu.md", "quickstart") in [(page, name) for page, name, _ in SAMPLES]


@pytest.mark.parametrize("page,name,sample", SAMPLES, ids=[f"{p}:{n}" for p, n, _ in SAMPLES])
def test_a_sample_recipe_has_the_shipped_values(page, name, sample):
    assert not disagreements(sample, name), page


def test_the_check_sees_a_changed_value_and_a_changed_default():
    sample = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    assert not disagreements(sample, "quickstart")
    sample["train"]["micro_batch_tokens"] *= 2
    sample["rollout"]["stop"] = ["\n"]  # the recipe leaves it at the default, []
    assert [line.split(":")[0] for line in disagreements(sample, "quickstart")] == ["rollout.stop",
                                                                                   "train.micro_batch_tokens"]


def paragraphs(text: str) -> list[str]:
    return [p.lstrip() for p in re.split(r"\n\s*\n", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)) if p.strip()]


def cut_short(text: str) -> list[str]:
    """Paragraphs that start in lower case (a sentence cut at its start), but for names written so."""
    return [p.split("\n")[0][:60] for p in paragraphs(text) if p[0].islower() and not p.startswith(("adarl ", "vLLM "))]


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_paragraph_starts_mid_sentence(page):
    assert not cut_short(page.read_text())


def test_the_check_sees_the_cluster_page_that_started_mid_phrase():
    before = "```bash\nadarl train recipes/ray_workers.yaml\n```\n\nturns on token authentication for `ray start`.\n"
    assert cut_short(before) == ["turns on token authentication for `ray start`."]


def test_recipes_page_shows_each_recipe_header_as_it_is():
    page = (ROOT / "docs" / "recipes.md").read_text()
    shown = dict(re.findall(r"^### ([\w.]+)\n\n\[`recipes/\1\.yaml`\]\(/repo/recipes/\1\.yaml\)\n\n```text\n(.*?)\n```",
                            page, re.M | re.S))
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        text = path.read_text()
        header = "\n".join(line[2:] for line in text[:text.index("\nname:")].splitlines())
        assert shown.get(path.stem) == header, f"docs/recipes.md's block for {path.name} is not its header"


def test_the_quickstart_problems_are_counted_as_the_pages_say():
    """Two numbers from 0 to 100 (reasoning-gym's 2 digits): the share of two 2-digit numbers, counted."""
    from adarl.tasks import build_task

    task = build_task(load_recipe(str(ROOT / "recipes" / "quickstart.yaml")).task)

    def two_digit_pairs(problems: list) -> int:
        numbers = [re.findall(r"\d+", p.prompt[-1]["content"]) for p in problems]
        assert all(len(n) == 2 and all(0 <= int(x) <= 100 for x in n) for n in numbers)
        return sum(all(len(x) == 2 for x in n) for n in numbers)

    said = (f"{two_digit_pairs(task.train):,} of its {len(task.train):,} training\nproblems and "
            f"{two_digit_pairs(task.eval)} of its {len(task.eval)} held-out ones add two 2-digit numbers")
    assert said == "1,602 of its 2,000 training\nproblems and 74 of its 100 held-out ones add two 2-digit numbers"
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started" / "cpu.md"):
        assert said in page.read_text() and "2-digit addition" not in page.read_text(), page.name

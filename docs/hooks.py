"""MkDocs hook: the repository's recipes and benchmark results become files of the site.

A page links them as `/repo/recipes/quickstart.yaml` or `/repo/bench/results/...`
(`validation.links.absolute_links: relative_to_docs` in mkdocs.yml), so `mkdocs build --strict`
fails on a link to a file that does not exist, and the built site serves the file.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("recipes", "bench/results")


def on_files(files: Files, config) -> Files:
    for folder in SHARED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file():
                file = File.generated(config, "repo/" + path.relative_to(ROOT).as_posix(), abs_src_path=str(path))
                if file.is_documentation_page():  # a results folder's README.md: served, not a page of the nav
                    file.inclusion = InclusionLevel.NOT_IN_NAV
                files.append(file)
    return files

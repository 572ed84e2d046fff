"""The commands the README and the docs show that start or join Ray (`adarl train recipes/ray_workers.yaml`,
`... cluster.address=auto`), run as tests/packaging_docs/test_doc_commands.py runs the rest: at their smallest
settings, piped at 80 columns, no traceback and no number cut short. Here, in the Ray group of tests
(tests/conftest.py: SHARED_GROUPS), so that no other Ray cluster runs beside them."""

from __future__ import annotations

import pytest

from doc_commands import PAGES, Command, page_commands
from stand_in import stand_in_recipes
from test_doc_commands import RAY, check, run

pytestmark = [pytest.mark.heavy, pytest.mark.model]
pytest.importorskip("ray")

CASES = [(page, c) for page in PAGES for c in page_commands(page) if RAY.search(c.text) and not c.help_of]


def test_the_docs_show_ray_commands():
    assert {c.text for _, c in CASES} >= {"adarl train recipes/ray_workers.yaml",
                                          "adarl train recipes/ray_workers.yaml cluster.address=auto"}


@pytest.mark.parametrize("page,command", CASES, ids=[f"{p}:{c.text}" for p, c in CASES])
def test_a_ray_command_of_a_page_runs(page, command, tiny_model_dir, tmp_path, monkeypatch):
    stand_in_recipes(tmp_path, tiny_model_dir, extra={"log.progress": True})
    monkeypatch.chdir(tmp_path)
    check(command, *run(command, tmp_path))


def test_compare_on_a_ray_address_without_a_cluster_says_so_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """`adarl compare --ray ADDRESS` (docs/getting-started/cluster.md) where no cluster runs: Ray's
    ConnectionError was a traceback; now one line that says how to start a cluster, before any run."""
    stand_in_recipes(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    command = Command("docs/getting-started/cluster.md", "adarl compare recipes/quickstart.yaml "
                      "recipes/quickstart_drgrpo.yaml --seeds 2 --budget-tokens 128 --ray auto")
    code, printed = run(command, tmp_path)
    assert code == 2 and "Traceback" not in printed, printed
    assert "error: --ray auto: no Ray cluster to join" in printed and "ray start --head" in printed, printed
    assert not (tmp_path / "runs").exists()

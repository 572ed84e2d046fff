"""Every command the README and the docs show runs, piped at 80 columns, at its smallest settings, and prints
full numbers and no traceback (issue 53's target).

The commands and their smallest settings: tests/packaging_docs/doc_commands.py. A page's commands run in its
order, in one folder holding the stand-in recipes (tests/config/stand_in.py: the tiny model, one step of 2 prompts
× 4 rollouts, progress lines on), so `adarl eval runs/first` finds the run the line before made; they run in this
process through the CLI (typer's runner: nothing is a terminal, COLUMNS=80), `python` lines as a process; an
`adarl train` without `--run-dir` starts where no run of its name is yet, as on a reader's machine (two pages'
lines train the quickstart into runs/quickstart). A command passes when it exits 0 (or prints what its `console`
block shows, or is refused as `REFUSED` says) with no traceback, no number cut short (`0.…`) and, for a `--help`,
no line over 80 columns. The commands that start or join Ray run in tests/cluster/test_ray_doc_commands.py, with
the other Ray tests.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from adarl.cli import app
from doc_commands import PAGES, ROOT, Command, page_commands, smallest
from stand_in import stand_in_recipes

pytestmark = pytest.mark.model

#: commands refused on this machine, as they should be: (a part of the command, what the refusal must say)
REFUSED = [
    # its dataset is not here: named, with the hardware the recipe is for and the command that fetches it
    ("gsm8k_qwen2.5", ("error:", "openai/gsm8k", "written for one GPU", "hf download openai/gsm8k")),
    # joins the cluster `ray start` made; none runs here: said in one line, with how to start one
    ("cluster.address=auto", ("error: cluster.address=auto: no Ray cluster to join", "ray start --head")),
]
#: what starts or joins a Ray cluster (tests/cluster/test_ray_doc_commands.py runs those)
RAY = re.compile(r"ray_workers|cluster\.backend=ray|cluster\.address|--ray\b")
CUT = re.compile(r"[\d.]…|…\d|…\s*[│┃]")  # a number, or a table cell, cut short
RECIPES_PAGE = "docs/recipes.md"


def files_a_page_asks_for(folder: Path) -> None:
    """What a page tells the reader to write before a command: recipes.md's `mixed_pool_vade.yaml` ("copy it
    with another `select` and name")."""
    data = yaml.safe_load((folder / "recipes" / "mixed_pool.yaml").read_text())
    data.update(name="mixed_pool_vade", select={"name": "vade"})
    (folder / "mixed_pool_vade.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def run(command: Command, folder: Path) -> tuple[int, str]:
    """The exit code and everything it printed (an uncaught exception's traceback included)."""
    if command.text.startswith("python "):
        done = subprocess.run([sys.executable, *shlex.split(command.text)[1:]], cwd=folder, capture_output=True,
                              text=True, timeout=600)
        return done.returncode, done.stdout + done.stderr
    argv = [command.help_of, "--help"] if command.help_of else shlex.split(smallest(command.text))[1:]
    if argv[0] == "train" and not {"--run-dir", "--resume", "--help"} & set(argv):  # a new run, as a reader starts it
        name = yaml.safe_load((folder / argv[1]).read_text())["name"]
        shutil.rmtree(folder / "runs" / name, ignore_errors=True)
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "80", "ADARL_AUTO_BACKEND": "hf"})
    printed = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        printed += "".join(traceback.format_exception(*result.exc_info))
    return result.exit_code, printed


def check(command: Command, code: int, printed: str) -> None:
    shown = f"{command.page}: `{command.text}`" + (f" (run as `{smallest(command.text)}`)"
                                                    if smallest(command.text) != command.text else "")
    assert "Traceback" not in printed, f"{shown} printed a traceback:\n{printed[-3000:]}"
    assert not CUT.search(printed), f"{shown} cut a number short:\n{printed[-3000:]}"
    if command.help_of:
        wide = [line for line in printed.splitlines() if len(line) > 80]
        assert code == 0 and not wide, f"{shown}: `adarl {command.help_of} --help` exit {code}, wider lines {wide}"
        return
    refusal = next((says for part, says in REFUSED if part in command.text), None)
    if command.expected or refusal:
        missing = [line for line in command.expected or refusal if line not in printed]
        assert code != 0 and not missing, f"{shown}: exit {code}, did not print {missing}:\n{printed[-3000:]}"
        return
    assert code == 0, f"{shown}: exit {code}:\n{printed[-3000:]}"


def sections(page: str) -> list[tuple[str, int]]:
    """A page, or for recipes.md (forty-odd trainings) each `## ` part, so that two workers share it."""
    return [(page, i) for i in range(len(_parts(page)))] if page == RECIPES_PAGE else [(page, 0)]


def _parts(page: str) -> list[list[Command]]:
    text = (ROOT / page).read_text()
    cuts = [m.start() for m in re.finditer(r"^## ", text, re.M)]
    commands = page_commands(page)
    return [[c for c in commands if start <= c.at < end] for start, end in zip([0, *cuts], [*cuts, len(text)],
                                                                                strict=True)]


def commands_of(page: str, index: int) -> list[Command]:
    return _parts(page)[index] if page == RECIPES_PAGE else page_commands(page)


CASES = [case for page in PAGES for case in sections(page) if commands_of(*case)]


@pytest.mark.parametrize("page,index", CASES, ids=[f"{p}#{i}" if p == RECIPES_PAGE else p for p, i in CASES])
def test_the_commands_of_a_page_run(page, index, tiny_model_dir, tmp_path, monkeypatch):
    stand_in_recipes(tmp_path, tiny_model_dir, extra={"log.progress": True})
    files_a_page_asks_for(tmp_path)
    monkeypatch.chdir(tmp_path)
    for command in commands_of(page, index):
        if not RAY.search(command.text) or command.help_of:
            check(command, *run(command, tmp_path))


def test_every_command_is_in_one_case():
    """recipes.md's parts hold each of its commands once (a command no part finds would never run)."""
    for page in PAGES:
        found = [c for case in sections(page) for c in commands_of(*case)]
        assert sorted(c.text for c in found) == sorted(c.text for c in page_commands(page)), page


def in_a_terminal(argv: list[str], cwd: Path, columns: int = 80) -> str:
    """What `argv` shows in a terminal `columns` wide (a pseudo-terminal; no COLUMNS: its size is read)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    child = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "xterm"})
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    child.wait(timeout=600)
    os.close(master)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n")


def test_a_table_fits_a_terminal_of_80_columns_in_full(tiny_model_dir, tmp_path):
    """`adarl eval`'s pass@k table of two tasks (wider than 80 drawn) in a real 80-column terminal: every line
    fits, every name and number whole (the piped runs above take their width from COLUMNS; a terminal's comes
    from its size). With the table drawn at any width, it showed `quic…` and `pass…`."""
    stand_in_recipes(tmp_path, tiny_model_dir)
    shown = in_a_terminal([sys.executable, "-m", "adarl.cli", "eval", str(tiny_model_dir), "--task",
                           "recipes/quickstart.yaml", "--task", "recipes/allocate_dars.yaml", "--k", "1,2,4", "--n",
                           "4", "--size", "4", "--backend", "hf", "--out", "eval.json"], tmp_path)
    lines = [line.rsplit("\r", 1)[-1] for line in shown.splitlines()]  # a progress bar redrawn: its last state
    assert "Traceback" not in shown and "…" not in shown, shown
    wide = [line for line in lines if len(line) > 80 and str(tiny_model_dir) not in line]  # a path is as long as it is
    assert not wide, wide
    task = json.loads((tmp_path / "eval.json").read_text())["tasks"]["quickstart"]
    numbers = [f"{v:.3f}" for v in (*task["pass@k"].values(), *task["avg@k"].values())]
    assert len(numbers) == 6 and all(n in shown for n in numbers) and f"{task['mean_length']:.1f}" in shown, shown

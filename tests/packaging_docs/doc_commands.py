"""The commands the README and the docs pages show, and how a test runs each at its smallest settings.

`page_commands(page)`: each `adarl ...` line of a fenced block (a `$ ` prompt and a recipe header's `command:`
dropped, `\\` continuations joined, a trailing `# comment` left out, the `adarl` part of `pip ... && adarl ...`),
each `python docs/...` line, and each whole `adarl ...` command quoted inline. A synopsis (`RECIPE.yaml`,
`[--k 8]`, `DIR`, `runs/<name>`, `...`) or a bare `adarl train` naming the command stands for its `--help`.
`make` and `pip` lines install; .ci/run runs those.

`smallest(command)`: the numbers a command gives cut to a test's (`CUTS`: steps to 2, seeds to 2,
`--budget-tokens` to 128 (two steps of the stand-in), `--size` to 4) and a built-in recipe's name made its file
under recipes/, where the test keeps the stand-in copies (tests/config/stand_in.py).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(adarl [^`]+)`")
#: blocks that hold no shell commands
NOT_SHELL = {"yaml", "python", "json", "jsonl", "toml", "py"}
#: a word that stands for one the reader gives: RECIPE.yaml, DIR, N, MODEL_OR_RUN, RUN/final, runs/<name>, ...
PLACEHOLDER = re.compile(r"(^|[\s/=])([A-Z][A-Z_]*\b(?![a-z])|recipe\.yaml\b)|[\[<…|]|\.\.\.")
#: the numbers a command gives, cut to a test's: (pattern, the largest kept)
CUTS = [(re.compile(r"(budget\.max_steps=)(\d+)"), 2), (re.compile(r"(--steps[ =])(\d+)"), 2),
        (re.compile(r"(--seeds[ =])(\d+)"), 2), (re.compile(r"(--budget-tokens[ =])(\d+)"), 128),
        (re.compile(r"(--size[ =])(\d+)"), 4)]


@dataclass(frozen=True)
class Command:
    page: str
    text: str  #: as the page shows it
    expected: tuple[str, ...] = ()  #: a `console` block's lines after the command: what it must print
    inline: bool = False  #: quoted in a sentence (`adarl sft --target solution` names an option, not a run)
    at: int = 0  #: where the page shows it first (a character offset)

    @property
    def help_of(self) -> str | None:
        """For a synopsis or a bare `adarl X`: X (its `--help` runs instead); else None."""
        words = self.text.split()
        if words[0] != "adarl" or words[1].startswith("-"):
            return None
        if len(words) == 2 or PLACEHOLDER.search(" ".join(words[2:])) or (self.inline and words[2].startswith("-")):
            return words[1]
        return None


def _lines(lang: str, body: str) -> list[tuple[str, tuple[str, ...]]]:
    """A fenced block's commands, each with the output lines a console block shows after it."""
    if lang in NOT_SHELL:
        return []
    out: list[tuple[str, list[str]]] = []
    for raw in body.replace("\\\n", " ").splitlines():
        line = raw.strip()
        prompt = line.startswith("$ ")
        line = line.removeprefix("$ ").removeprefix("command:").strip()
        for part in line.split("&&"):
            part = re.sub(r"\s+#.*$", "", part).strip()
            part = re.sub(r"\s+\(.*\)$", "", part)  # a header's "(make demo: the same, ...)"
            if re.match(r"(adarl|python docs/)\S*\s", part + " "):
                out.append((" ".join(part.split()), []))
                break
        else:
            if lang == "console" and out and not prompt and line:
                out[-1][1].append(line)
    return [(text, tuple(expected)) for text, expected in out]


def page_commands(page: str) -> list[Command]:
    """The page's commands, once each (a synopsis once per command), in the page's order."""
    text = (ROOT / page).read_text()
    fences = list(FENCE.finditer(text))
    found = [(m.start(), Command(page, c, e)) for m in fences for c, e in _lines(*m.groups())]
    found += [(m.start(), Command(page, " ".join(m.group(1).split()), inline=True)) for m in INLINE.finditer(text)
              if not any(f.start() <= m.start() < f.end() for f in fences)]
    seen, out = set(), []
    for at, c in sorted(found, key=lambda pair: pair[0]):
        key = f"{c.help_of} --help" if c.help_of else c.text
        if key not in seen:
            seen.add(key)
            out.append(Command(c.page, c.text, c.expected, c.inline, at))
    return out


def smallest(text: str) -> str:
    for pattern, most in CUTS:
        text = pattern.sub(lambda m, most=most: m.group(1) + str(min(int(m.group(2)), most)), text)
    words = shlex.split(text)
    if len(words) > 2 and words[0] == "adarl" and words[1] in ("train", "sft", "compare"):
        builtins = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
        words = [f"recipes/{w.removesuffix('.yaml')}.yaml" if w.removesuffix(".yaml") in builtins and "/" not in w
                 else w for w in words]
    return shlex.join(words)

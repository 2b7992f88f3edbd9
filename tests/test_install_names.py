"""Install instructions name this project, never another: the package index's "pyfa" is an
unrelated project, so a `pip install pyfa` or `pip install "pyfa[torch]"` in the docs or
in an error message would install somebody else's code. The distribution is
pyfa/_version.py's DISTRIBUTION (pyproject.toml's name); from a checkout, `pip install .`
or `pip install ".[extra]"`."""

import re
from pathlib import Path

import pytest

from pyfa._version import DISTRIBUTION

REPO = Path(__file__).resolve().parents[1]
# Every text a user reads an install line from: the docs, and the package's messages.
SOURCES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "tools").glob("*.md"),
                  *(REPO / "pyfa").rglob("*.py")])


# Where a command's arguments end: a shell operator, or the prose around it ("pip
# install ".[torch]" at a pyfa checkout's root", "pip install torch, or ...").
ENDS = {"&&", "||", ";", "|", "at", "or", "and", "in", "from", "to", "then", "brings"}


def requirements(line):
    """The requirement words of one `pip install ...` command: its arguments up to the
    end of the command, unquoted, without options."""
    words = []
    for word in line.split():
        if word in ENDS:
            break
        last = word.endswith((",", ")", ";"))
        word = word.strip("\"'\\,;)")
        if word and not word.startswith("-") and word != ".":
            words.append(word.rstrip("."))
        if last:
            break
    return words


def foreign(requirement):
    """True for a requirement that resolves to the index's unrelated "pyfa"."""
    name = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0]
    return name.lower().replace("_", "-") == "pyfa"


def install_lines(text):
    """The arguments of every `pip install` in text, each up to the next one (or the end of
    its line or code span)."""
    text = text.replace("\\\n", " ")
    return [m.group(1) for m in re.finditer(r"pip install\s+((?:(?!pip install)[^`\n])*)", text)]


def test_the_distribution_name_is_not_the_index_s_pyfa():
    pyproject = (REPO / "pyproject.toml").read_text()
    name = re.search(r'^name = "([^"]+)"', pyproject, re.M).group(1)
    assert name == DISTRIBUTION
    assert not foreign(name)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_install_line_names_another_project(path):
    bad = []
    for line in install_lines(path.read_text()):
        for word in requirements(line):
            if foreign(word):
                bad.append(f"pip install {line.strip()}")
    assert not bad, f"{path.relative_to(REPO)}: {bad}"


def test_the_checker_finds_the_lines_it_must_refuse():
    for text in ('pip install "pyfa[torch]"', "pip install pyfa", "`pip install -U pyfa`",
                 "(pip install torch, or pip install \\\"pyfa[report]\\\")",
                 "python -m pip install pyfa==0.1.0"):
        assert any(foreign(w) for line in install_lines(text) for w in requirements(line)), text
    for text in ('pip install ".[torch]"', "pip install . && python -m pyfa",
                 "pip install matplotlib", f"pip install {DISTRIBUTION}",
                 "pip install -e .[dev]", "pip install pyfa-fp32[torch]"):
        assert not any(foreign(w) for line in install_lines(text) for w in requirements(line)), text


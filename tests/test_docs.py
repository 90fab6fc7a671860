"""The README stays a first page, and what it and docs/ point at exists.

The README is what a user reads first: it must stay short (``MAX_README_LINES``), its two
commands must be the ones CI runs (``.ci/run`` installs with the first command's pip installs
and runs the second), and every link and every repository path it names must lead somewhere.
The same holds for the pages under ``docs/`` and for CHANGELOG.md. Reference pages state
current facts; the history of how figures changed belongs in CHANGELOG.md, so a few phrases
that only history uses are refused outside it.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CHANGELOG = REPO / "CHANGELOG.md"
CI_SCRIPT = REPO / ".ci" / "run"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, CHANGELOG, *DOCS]
MAX_README_LINES = 250

# [text](target) and ![alt](target), with an optional "title"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = ("http://", "https://", "mailto:")
# A repository path named in inline code: `localspec/models/hardware.py`, `presets/*.toml`
_REPO_PATH = re.compile(r"`((?:localspec|tests|presets|scripts|docs|\.ci)/[^`\s]*)`")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_HISTORY = ("previous release", "earlier version", "release ago", "releases ago",
            "before this change")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a link or path inside one is an example)."""
    return _FENCE.sub("", text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose(_text(path)).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = _anchor(match.group(1))
            anchor, n = base, 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def _bash_blocks(text: str) -> list[list[str]]:
    """The non-empty lines of each ```bash block, in order."""
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        blocks.append([line.strip() for line in match.group(1).splitlines() if line.strip()])
    return blocks


def _without_quiet(command: str) -> list[str]:
    return [word for word in shlex.split(command) if word not in ("-q", "--quiet")]


def test_pages_exist() -> None:
    assert README.is_file() and CHANGELOG.is_file()
    assert DOCS, "docs/ holds the reference pages"


def test_readme_is_a_first_page() -> None:
    lines = _text(README).count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines; a first page has at most {MAX_README_LINES}: move "
        "reference to docs/ and history to CHANGELOG.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link leads to a file or folder of the repository (and to a heading
    there, when it names one)."""
    broken = []
    for target in _LINK.findall(_prose(_text(page))):
        if target.startswith(_EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists() or not linked.is_relative_to(REPO):
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{page.name}: {broken}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_paths_exist(page: Path) -> None:
    """A path such as `localspec/models/hardware.py` in the text names a real file (templates
    with <placeholders> aside; globs must match something). CHANGELOG.md may name files that
    have since moved."""
    missing = []
    for name in _REPO_PATH.findall(_prose(_text(page))):
        if "<" in name:
            continue
        if any(c in name for c in "*?["):
            if not glob.glob(str(REPO / name)):
                missing.append(name)
        elif not (REPO / name).exists():
            missing.append(name)
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_reference_pages_hold_no_history(page: Path) -> None:
    text = _text(page).lower()
    found = [phrase for phrase in _HISTORY if phrase in text]
    assert found == [], f"{page.name}: history belongs in CHANGELOG.md, found {found}"


def _command_drift(readme: str, ci: str) -> list[str]:
    """How the README's two commands differ from what the CI script ``ci`` runs (empty: in
    step). The first ```bash block is one line, ``pip install ... && ... && python3 app.py``,
    whose installs must be the script's ``python3 -m pip install`` lines in order (``-q``
    aside); the second is the test command, the script's last command."""
    blocks = _bash_blocks(readme)
    if len(blocks) < 2 or len(blocks[0]) != 1 or len(blocks[1]) != 1:
        return ["README starts with two one-line ```bash blocks: install and run, then test"]
    drift = []
    steps = [step.strip() for step in blocks[0][0].split("&&")]
    if steps[-1] != "python3 app.py":
        drift.append(f"the first command ends with {steps[-1]!r}, not 'python3 app.py'")
    ci_lines = [line.strip() for line in ci.splitlines()]
    ci_installs = [line for line in ci_lines if line.startswith("python3 -m pip install ")]
    if [_without_quiet(s) for s in steps[:-1]] != [_without_quiet(c) for c in ci_installs]:
        drift.append(f"README installs with {steps[:-1]}, CI with {ci_installs}")
    commands = [line for line in ci_lines if line and not line.startswith("#")]
    if not commands or blocks[1][0] != commands[-1]:
        drift.append(f"README tests with {blocks[1][0]!r}, CI ends with "
                     f"{commands[-1] if commands else None!r}")
    return drift


def test_readme_commands_are_the_ones_ci_runs() -> None:
    """The README's first command installs exactly as .ci/run does and then starts the app; its
    second is exactly the test command .ci/run ends with. Neither can change alone."""
    assert _command_drift(_text(README), _text(CI_SCRIPT)) == []
    assert _bash_blocks(_text(README))[1] == ["python3 -m pytest"]


@pytest.mark.parametrize("old, new", [
    ("--no-deps -r requirements-models.txt", "-r requirements-models.txt"),
    ("python3 -m pip install -q -r requirements.txt\n", ""),
    ("python3 -m pytest\n", "python3 -m pytest -x\n"),
])
def test_command_drift_is_seen(old: str, new: str) -> None:
    """Negative control: the real CI script with one flag, install or test command changed no
    longer matches the real README."""
    ci = _text(CI_SCRIPT)
    assert old in ci
    assert _command_drift(_text(README), ci.replace(old, new)) != []

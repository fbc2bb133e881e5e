"""The README and docs/ as a user reads them: the README stays a front door, every `gguf-trainer` command they show
is one the CLI takes, and every page they point to is there. In-process and cheap: the parser is built, not run."""

import argparse
import re
from functools import cache
from pathlib import Path

from gguf_assets.cli.commands import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 150
# The README's first lines after the title: CI (.ci/run) and the team start from these two commands.
SETUP_COMMANDS = [
    "```bash",
    "bash scripts/demo.sh   # sets up .venv, then runs the full pipeline on the built-in tiny demo project",
    "bash scripts/test.sh   # sets up .venv, then runs the tests",
    "```"]
# Where each section of the README of before #67 (730 lines) went, so an old pointer still finds its text.
OLD_README_SECTIONS = {
    "Using it": "using.md",
    "Reading the result": "results.md",
    "Tests and lint": "testing.md",
    "Benchmarks": "testing.md",
    "What is checked before it is reused": "faults.md",
    "Layout": "code_layout.md",
    "Changing settings": "using.md",
    "Runs": "runs.md",
    "Snapshots, kept steps, and changing the step count": "runs.md",
    "The Dagster CLI": "dagster.md",
    "Surviving reboots": "dagster.md",
}

_FENCED_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`]+)`")
# Where a shown command line ends: a comment, a pipe, a redirect, `;`, `&&`, or the `)"` of `"$(...)"`.
_COMMAND_END = re.compile(r"\s#|[|;&)\"']|\s>")
_COMMENT = re.compile(r"(^|\s)#.*")
# The program where it is run: first on the line, or after a path, `ExecStart=` or `$(`; "the gguf-trainer console
# script" in the code map is prose.
_PROGRAM = re.compile(r"(?:^|(?<=[/=(]))gguf-trainer(?=\s|$)")
_MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOCS_MENTION = re.compile(r"(?<![\w/.])docs/[\w./-]+\.md")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _verbs() -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def shown_commands(text: str) -> list[list[str]]:
    """The words after `gguf-trainer` of each command a page shows: on a line of a fenced block or in an inline code
    span (`.venv/bin/gguf-trainer runs DIR --compare A B`), and an inline span that starts with a verb and names a
    flag (`run --workers auto`). Prose that names the program (`gguf-trainer` is a thin client) shows no command."""
    verbs = _verbs()
    fenced = [_COMMENT.sub("", line) for block in _FENCED_BLOCK.findall(text) for line in block.splitlines()]
    spans = _CODE_SPAN.findall(_FENCED_BLOCK.sub("", text))
    commands = []
    for snippet in fenced + spans:
        for match in _PROGRAM.finditer(snippet.strip()):
            commands.append(_COMMAND_END.split(snippet.strip()[match.end():])[0].split())
    for span in spans:
        words = span.split()
        if words and words[0] in verbs and any(w.startswith("--") for w in words):
            commands.append(_COMMAND_END.split(span)[0].split())
    return [words for words in commands if words]


def command_problems(text: str) -> list[str]:
    """Each shown command whose verb or `--flag` the CLI's parser does not take (spelled out: argparse would take
    an abbreviation, a reader should not have to)."""
    verbs = _verbs()
    problems = []
    for words in shown_commands(text):
        shown = "gguf-trainer " + " ".join(words)
        if words[0].startswith("-"):
            options = _parser()._option_string_actions
        elif words[0] in verbs:
            options = verbs[words[0]]._option_string_actions
        else:
            problems.append(f"`{shown}`: gguf-trainer has no command {words[0]!r} (it has {', '.join(verbs)})")
            continue
        for word in words:
            flag = word.strip("[]").split("=")[0]
            if flag.startswith("--") and flag not in options:
                problems.append(f"`{shown}`: {flag} is not an option of "
                                f"{'gguf-trainer' if words[0].startswith('-') else words[0]}")
    return problems


def test_readme_is_a_front_door():
    """Under 150 lines, and the two set-up commands stay its first lines after the title."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines (under {README_MAX_LINES}): move the detail to a page of docs/")
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2:6] == SETUP_COMMANDS, lines[:6]


def test_every_command_shown_exists_in_the_cli():
    found = {}
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        found[page.name] = len(shown_commands(text))
        problems = command_problems(text)
        assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)
    # The reading finds the commands the pages are made of (the README's first project, using.md's list, runs.md's).
    assert found.get("README.md", 0) >= 4 and found.get("using.md", 0) >= 16 and found.get("runs.md", 0) >= 12, found


def test_a_wrong_command_is_named():
    """The check itself: a misspelt flag, a flag of another verb, an unknown verb and an unknown global flag are each
    named, on a line of a fenced block and in a span; a flag spelt out, a comment and prose are not."""
    text = ("```bash\n.venv/bin/gguf-trainer run my-project --wrokers 2   # not --cancel-on-stopp\n"
            'eval "$(.venv/bin/gguf-trainer env my-project)" --not-its-flag\n```\n'
            "Then `ui --port 3000 --repair`, `gguf-trainer launch DIR`, `gguf-trainer --auto-resum DIR`, and\n"
            "`gguf-trainer runs DIR --compare A B [--svg FILE]`; `gguf-trainer` is a thin client.\n")
    problems = command_problems(text)
    assert sorted(p.split(": ", 1)[1] for p in problems) == sorted([
        "--wrokers is not an option of run", "--repair is not an option of ui",
        f"gguf-trainer has no command 'launch' (it has {', '.join(_verbs())})",
        "--auto-resum is not an option of gguf-trainer"]), problems


def test_every_command_of_the_cli_is_listed_in_using():
    """docs/using.md lists every verb, so a new one gets its line there."""
    text = (DOCS / "using.md").read_text(encoding="utf-8")
    listed = {words[0] for words in shown_commands(text)}
    assert set(_verbs()) <= listed, f"docs/using.md: add a line for {sorted(set(_verbs()) - listed)}"


def test_every_relative_link_resolves():
    """A Markdown link in the README or docs/ leads to a file that is there, relative to the page; a `docs/NAME.md`
    named anywhere in them, in the code's messages, the benchmarks or the scripts, relative to the repository."""
    missing = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for target in _MARKDOWN_LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or a heading on the same page
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: link to {target}")
    sources = [*_pages(), *(ROOT / "gguf_assets").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
               *(ROOT / "scripts").glob("*.*")]
    for source in sources:
        for mention in _DOCS_MENTION.findall(source.read_text(encoding="utf-8")):
            if not (ROOT / mention).exists():
                missing.append(f"{source.relative_to(ROOT)}: names {mention}")
    assert not missing, "\n".join(missing)


def test_each_section_of_the_old_readme_has_its_page():
    """Each heading of the README before #67 is a heading of the page it moved to, and the README links that page."""
    readme = README.read_text(encoding="utf-8")
    for heading, page in OLD_README_SECTIONS.items():
        headings = [line.lstrip("#").strip() for line in (DOCS / page).read_text(encoding="utf-8").splitlines()
                    if line.startswith("#")]
        assert any(h == heading or h.startswith(heading + ":") for h in headings), (
            f"docs/{page}: no heading {heading!r} (its headings: {headings})")
        assert f"](docs/{page})" in readme, f"README.md does not link docs/{page}"

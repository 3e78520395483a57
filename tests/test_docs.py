"""The docs name only commands and flags the CLI has: every ``daskpipe ...`` example in docs/ and
the README (fenced shell blocks and inline code) resolves to a real subcommand, and each of its
``--flags`` is an option of that subcommand."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from daskpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`]+)`")  # spans pair up from the start of the text once fenced blocks are out


def examples(text: str) -> list[str]:
    """The ``daskpipe ...`` command lines of a page: lines of fenced blocks, and inline code spans."""
    lines = [line.strip() for block in FENCED.findall(text) for line in block.splitlines()]
    found = [line.split("#")[0].strip() for line in lines if line.startswith("daskpipe ")]
    spans = INLINE.findall(FENCED.sub("", text))
    return found + [span.strip() for span in spans if span.startswith("daskpipe ")]


def resolve(words: list[str]) -> tuple[click.Command, list[str]]:
    """The deepest subcommand that ``words`` name, and its path."""
    command: click.Command = main
    path: list[str] = []
    for word in words:
        if not isinstance(command, click.Group):
            break
        sub = command.get_command(click.Context(command), word)
        if sub is None:
            break
        command, path = sub, [*path, word]
    return command, path


def problems(line: str) -> list[str]:
    words = line.split()[1:]
    if words == ["--help"] or (words and words[0].isupper()):  # `daskpipe COMMAND --help`: a placeholder
        return []
    command, path = resolve([w for w in words if re.fullmatch(r"[a-z][a-z0-9-]*", w)])
    if not path:
        return [f"{line!r} names no daskpipe subcommand"]
    options = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
    return [
        f"{line!r}: `daskpipe {' '.join(path)}` has no {flag}"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line)
        if flag not in options | {"--help"}
    ]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_documented_command_and_flag_exists(page):
    found = [p for line in examples(page.read_text()) for p in problems(line)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_wrong_flag_and_a_wrong_command():
    assert problems("daskpipe plan --profiles P --out plan.json") == []
    assert problems("daskpipe plan ... --json plan.json") == ["'daskpipe plan ... --json plan.json': `daskpipe plan` has no --json"]
    assert problems("daskpipe frobnicate --x") == ["'daskpipe frobnicate --x' names no daskpipe subcommand"]
    assert examples("text `daskpipe demo --duration 5` and\n```bash\ndaskpipe bench chaos --fault stop  # a comment\n```\n") == [
        "daskpipe bench chaos --fault stop",
        "daskpipe demo --duration 5",
    ]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``,
    a repeated heading numbered from ``-1``."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCED.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    found = []
    for target in LINK.findall(FENCED.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            found.append(f"{target}: no {linked.relative_to(ROOT)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            found.append(f"{target}: no heading #{anchor} in {linked.name}")
    return found


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """A link to another page, or to a heading of one, leads there (pages move and headings change)."""
    found = broken_links(page)
    assert not found, "\n".join(found)


def test_anchors_follow_github():
    page = ROOT / "docs" / "benchmarks.md"
    assert {"the-request-paths-cost-daskpipe-bench-runtime", "november-29-later", "tried-not-kept"} <= anchors(page)

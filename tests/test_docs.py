"""The documentation's commands and links stay valid: every `dominotree ...` command in a bash block
of the README and docs/ parses with the CLI as it is now (bench method specs included), and every
relative link points at a file that exists. Nothing is run: a renamed flag or a moved results
directory fails here instead of in a reader's terminal."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dominotree.bench.methods import expand_methods
from dominotree.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ASSIGNMENT = re.compile(r'^([A-Z_][A-Z0-9_]*)="([^"]*)"$')


def shell_lines(text: str) -> list[str]:
    """The logical lines of every ```bash block (continuations joined)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        block = re.sub(r"\\\n\s*", " ", block)
        lines += [line.strip() for line in block.splitlines() if line.strip()]
    return lines


def dominotree_commands(text: str) -> list[list[str]]:
    """argv (without the program name) of each `dominotree` command, with the block's simple
    NAME="value" assignments substituted (TRAINING.md shares options through one) and a synopsis's
    bracketed optional parts and bare `...` left out."""
    env, commands = {}, []
    for line in shell_lines(text):
        for part in re.split(r"&&|;|\|", line):
            part = part.strip()
            m = ASSIGNMENT.match(part)
            if m:
                env[m.group(1)] = m.group(2)
                continue
            for name, value in env.items():
                part = part.replace(f"${name}", value)
            part = re.sub(r"\[[^\]]*\]", "", part)        # a synopsis's [optional ...] parts
            part = re.sub(r"(?<=\s)\.\.\.(?=\s|$)", "", part)  # ... and its unquoted "..."
            words = shlex.split(part, comments=True)
            if words[:1] == ["nohup"]:
                words = words[1:]
            if words[:1] == ["dominotree"] and not any("$" in w for w in words):
                commands.append(words[1:])
    return commands


def all_commands():
    for doc in DOCS:
        for argv in dominotree_commands(doc.read_text()):
            yield pytest.param(argv, id=f"{doc.name}: {' '.join(argv)[:70]}")


def test_the_docs_hold_commands():
    assert sum(1 for _ in all_commands()) > 30


@pytest.mark.parametrize("argv", list(all_commands()))
def test_documented_command_parses(argv):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`dominotree {' '.join(argv)}` does not parse (exit {e.code})")
    if args.command == "bench" and not getattr(args, "report_only", None):
        expand_methods(args.methods, args.preset)     # raises on an unknown method or option


def test_command_extraction_joins_continuations_and_expands_assignments():
    text = ('```bash\nC="--steps 5 --lr 1e-3"\ndominotree train dflash $C \\\n    --out runs/x   # a comment\n'
            'make setup && dominotree models --json\nls | head\ndominotree train domino --lr 1 [--x Y] ...\n'
            'dominotree generate "..."\n```\n')
    assert dominotree_commands(text) == [["train", "dflash", "--steps", "5", "--lr", "1e-3", "--out", "runs/x"],
                                         ["models", "--json"], ["train", "domino", "--lr", "1"],
                                         ["generate", "..."]]


def test_a_stale_command_is_caught():
    (bad,) = dominotree_commands("```bash\ndominotree bench --methods dominotree:bugdet=8\n```\n")
    with pytest.raises(ValueError, match="bugdet"):
        expand_methods(build_parser().parse_args(bad).methods, None)
    (bad,) = dominotree_commands("```bash\ndominotree generate --budgett 8 hi\n```\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(bad)


def relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links
            if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_exist(doc):
    missing = [link for link in relative_links(doc.read_text()) if not (doc.parent / link).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"

"""Every command's --help ends with an example, and every example parses as that command's usage."""

from __future__ import annotations

import re
import shlex

import click
import pytest

from magpie.cli import main
from magpie.cli.examples import EXAMPLES, walk

COMMANDS = sorted(" ".join(p) for p, _ in walk(main))


@pytest.mark.parametrize("path", COMMANDS)
def test_every_command_help_has_an_example(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proxies.txt").write_text("127.0.0.1:8080\n")  # the file the examples name
    cmd = dict((" ".join(p), c) for p, c in walk(main))[path]
    text = cmd.get_help(click.Context(cmd, info_name=path))
    assert "Example:" in text, path
    starts = ("magpie", "TOKEN", "curl", "MAGPIE", "PROXY")
    lines = [ln.strip() for ln in text.split("Example:", 1)[1].splitlines() if ln.strip().startswith(starts)]
    assert lines, path
    assert any(parse(line, path) for line in lines), path


def parse(line: str, path: str) -> bool:
    """Resolve the example's command and let click parse its options and arguments (nothing runs)."""
    line = line.split("#")[0].split("|")[-1].strip()
    line = re.sub(r"^TOKEN=\$\((.*)\)$", r"\1", line).split("&&")[-1].strip()
    words = [w for w in shlex.split(line) if not re.fullmatch(r"[A-Z_]+=.*", w)]
    assert words[0] == "magpie", line
    cmd, args, names = main, words[1:], []
    while isinstance(cmd, click.Group):
        names.append(args[0])
        cmd, args = cmd.commands[args[0]], args[1:]
    if " ".join(names) != path:  # a step before the command itself (magpie queue pause && ...)
        return False
    cmd.make_context(path, list(args))
    return True


def test_examples_name_existing_commands_only():
    assert set(EXAMPLES) <= set(COMMANDS)


def test_relative_downgrade_revision_is_an_argument_not_an_option():
    cmd = main.commands["db"].commands["downgrade"]
    ctx = cmd.make_context("downgrade", ["-1", "--yes"])
    assert ctx.params == {"revision": "-1", "yes": True}

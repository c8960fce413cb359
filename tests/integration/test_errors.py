"""One refusal vocabulary and one exception base.

``magpie.errors.Refusal`` is the code table; ``lua/lib.lua`` names the same codes (``R_LEASE_LOST``, ...),
every script refuses with one of those names rather than a bare negative number or a text code, and
``magpie.queue.refusal`` maps each code to its exception. Every exception class magpie defines derives
from ``MagpieError``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from magpie.errors import MagpieError, Refusal, RefusedError
from magpie.queue import LeaseLost, QueueError, refusal
from magpie.queue.keys import QueueKeys
from magpie.queue.scripts import LUA_DIR

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "lua"


def _lua_constants() -> dict[str, int]:
    """``R_*`` names and values of the ``local R_A, R_B = -1, -2`` lines of ``lua/lib.lua``."""
    found: dict[str, int] = {}
    for line in (LUA / "lib.lua").read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r"local\s+(R_\w+(?:\s*,\s*R_\w+)*)\s*=\s*(-?\d+(?:\s*,\s*-?\d+)*)\s*", line)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            values = [int(v) for v in m.group(2).split(",")]
            assert len(names) == len(values), line
            found.update(zip(names, values))
    return found


def _code_lines(path: Path):
    """``(line number, code without its comment)`` of a Lua file (no script puts ``--`` in a string)."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        yield n, line.split("--", 1)[0]


def test_lua_constants_mirror_the_refusal_table():
    assert _lua_constants() == {f"R_{code.name}": code.value for code in Refusal}


def test_scripts_refuse_with_named_constants_only():
    scripts = sorted(LUA.rglob("*.lua"))
    assert len(scripts) > 10
    constants = _lua_constants()
    bare = re.compile(r"(\breturn\b|=)\s*\{?\s*-\s*\d")  # return -2 / x = -1 / ok == -1
    labels = re.compile(r"""['"](%s)['"]""" % "|".join(code.label for code in Refusal))
    offences = []
    for path in scripts:
        for n, code in _code_lines(path):
            if path.name == "lib.lua" and code.lstrip().startswith("local R_"):
                continue
            if bare.search(code) or labels.search(code):
                offences.append(f"{path.name}:{n}: {code.strip()}")
            offences += [f"{path.name}:{n}: unknown {name}" for name in re.findall(r"\bR_[A-Z_]+\b", code)
                         if name not in constants]
    assert offences == []


def test_constants_evaluate_to_the_codes_in_redis(redis_client, redis_prefix):
    """The prelude the scripts run with defines every constant with its value."""
    names = [f"R_{code.name}" for code in Refusal]
    text = (LUA_DIR / "lib.lua").read_text(encoding="utf-8") + "\nreturn { %s }" % ", ".join(names)
    keys = QueueKeys(redis_prefix, 1).core()
    assert redis_client.eval(text, len(keys), *keys) == [code.value for code in Refusal]


@pytest.mark.parametrize("code", list(Refusal), ids=lambda c: c.label)
def test_the_mapper_gives_every_code_its_exception(code):
    exc = refusal(code.value, "abc")  # scripts reply plain integers
    assert isinstance(exc, QueueError) and isinstance(exc, RefusedError) and isinstance(exc, MagpieError)
    assert type(exc) is (LeaseLost if code is Refusal.LEASE_LOST else QueueError)
    assert exc.code is code and exc.label == code.label
    assert exc.member == exc.subject == "abc"
    assert str(exc) == f"{code.label}: route abc"


def test_refusals_carry_a_text_code_and_detail():
    assert QueueError("not_paused").code is Refusal.NOT_PAUSED  # a label names the code too
    assert str(QueueError(Refusal.NOT_PAUSED)) == "not_paused"
    exc = refusal(Refusal.LAYOUT_MISMATCH, detail="schedule has 4 shards")
    assert str(exc) == "layout_mismatch: schedule has 4 shards" and exc.member == ""
    for not_a_refusal in (0, 1, 2, -99):
        with pytest.raises(ValueError):
            refusal(not_a_refusal)


_WALK = r"""
import importlib, inspect, json, pkgutil, sys
import click
import magpie
from magpie.errors import MagpieError

# click's report types carry a MagpieError to click's exit status; they translate, they are not raised
# by magpie's own code paths, so they keep click's base alone.
ADAPTERS = (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)

bad, broken = [], []
for info in pkgutil.walk_packages(magpie.__path__, "magpie.", onerror=lambda name: broken.append(name)):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        continue
    try:
        mod = importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "magpie":
            continue  # an optional extra that is not installed
        broken.append(f"{info.name}: {exc!r}")
        continue
    except Exception as exc:
        broken.append(f"{info.name}: {exc!r}")
        continue
    for name, cls in inspect.getmembers(mod, inspect.isclass):
        if (cls.__module__ == mod.__name__ and issubclass(cls, BaseException) and not name.startswith("_")
                and not issubclass(cls, (MagpieError, *ADAPTERS))):
            bad.append(f"{mod.__name__}.{name}")
print(json.dumps({"bad": sorted(set(bad)), "broken": broken}))
"""


def test_every_exception_class_derives_from_magpie_error():
    """Walks every module of the package (in a child process: imports have side effects)."""
    out = subprocess.run([sys.executable, "-c", _WALK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"bad": [], "broken": []}

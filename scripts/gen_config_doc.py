"""Write docs/configuration.md from the settings model (magpie.config.Settings).

    python scripts/gen_config_doc.py            # rewrite docs/configuration.md
    python scripts/gen_config_doc.py --check    # exit 1 when the file is stale (tests and CI)

Each setting's environment variable, type, default and bounds come from the pydantic field; its
description is the docstring under the field in magpie/config.py (read with ``ast``, so the settings
module needs no special configuration). Sections follow the ``# --- settings: <name> ---`` markers of the
model. Defaults of secrets are shown only as "(development default)" or "unset".
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magpie import config  # noqa: E402
from magpie.base import redact  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"
SECTION = re.compile(r"^\s*# --- settings: (.+?) ---\s*$")
HEADER = """# Configuration reference

Generated from the settings model (`magpie/config.py`) by `python scripts/gen_config_doc.py`; do not edit
by hand (a test fails when this file is stale). Every setting is an environment variable (a `.env` file in
the working directory is read too). A bad value stops the process at start with one line naming the
variable. Durations are seconds unless the name says `_MS`; bounds are inclusive unless marked `>` / `<`.
"""


FALLBACK: dict[str, str] = {}
"""Descriptions of fields that carry no docstring in the model yet (a docstring, once written, wins)."""


def _docstrings() -> dict[str, tuple[str, str]]:
    """Field name -> (section, docstring) from the source of :class:`Settings`."""
    source = inspect.getsource(config)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    markers = [(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := SECTION.match(line))]
    out: dict[str, tuple[str, str]] = {}
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = inspect.cleandoc(nxt.value.value)
        section = "core"
        for line_no, name in markers:
            if line_no < node.lineno:
                section = name
        out[node.target.id] = (section, doc)
    return out


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return (text or str(annotation)).replace("typing.", "").replace("NoneType", "None")


def _num(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {_num(v)}")
        if getattr(m, "min_length", None) is not None:
            parts.append(f"length >= {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            parts.append(f"length <= {m.max_length}")
        if getattr(m, "pattern", None):
            parts.append(f"pattern `{m.pattern}`")
    return ", ".join(parts)


def _default(name: str, field) -> str:
    value = field.default
    if redact.is_secret(name):
        return "unset" if value in (None, "") else "(development default)"
    if value is None:
        return "unset"
    if value == "":
        return '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{_num(value)}`"
    return f"`{redact.mask_url_passwords(str(value))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole configuration.md text."""
    docs = _docstrings()
    sections: dict[str, list[str]] = {}
    for key, field in config.Settings.model_fields.items():
        env = (field.alias or key).upper()
        section, doc = docs.get(key, ("core", ""))
        doc = doc or FALLBACK.get(key, "")
        row = (f"| `{env}` | {_cell(_type(field.annotation))} | {_cell(_default(env, field))} | "
               f"{_cell(_bounds(field))} | {_cell(doc) or '-'} |")
        sections.setdefault(section, []).append(row)
    out = [HEADER]
    for section, rows in sections.items():
        out.append(f"\n## {section[0].upper()}{section[1:]}\n")
        out.append("| variable | type | default | bounds | description |")
        out.append("|---|---|---|---|---|")
        out.extend(rows)
    total = sum(len(r) for r in sections.values())
    out.append(f"\n{total} settings.\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) docs/configuration.md; returns the exit status."""
    ap = argparse.ArgumentParser(description=textwrap.dedent(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from the model")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_config_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

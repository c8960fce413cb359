"""The repository stands on its own: no file names a document outside it, and nothing names work items."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = [
    (re.compile(r"DESIGN\.md"), "a design document outside the repository (use docs/design.md)"),
    (re.compile(r"\bissue\s*#?\d+", re.I), "a work-item number"),
    (re.compile(r"beside this repository|shared folder", re.I), "a folder outside the repository"),
]


def tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in out.split():
        path = ROOT / name
        if path.suffix in {".py", ".md", ".lua", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".sh", ".mako", ""} \
                and path.is_file() and path.name != Path(__file__).name:
            yield path


def test_no_file_points_outside_the_repository_or_names_work_items():
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for pattern, why in FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r} ({why})")
    assert not hits, "\n".join(hits)


def test_readme_links_resolve_inside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert not target.startswith(("http://", "https://", "/", "..")), target
        assert (ROOT / target).exists(), target

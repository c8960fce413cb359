"""The files a deployment runs from, shipped inside the package and written out by ``magpie init DIR``.

:data:`FILES` maps each file's place in a deployment directory to its place in the source tree (the
same path). The wheel carries a copy of each under ``magpie/deployment_files/`` (``setup.py`` copies them
at build time, as this module is their one list); a checkout (an editable install) reads them from the
tree. Standard library only: ``setup.py`` loads this file before magpie's dependencies exist.
"""

from __future__ import annotations

from pathlib import Path

FILES: tuple[str, ...] = (
    "Procfile",
    "celeryconfig.py",
    "flowerconfig.py",
    "alembic.ini",
    "deploy/prometheus/rules.yml",
    "deploy/grafana/magpie.json",
)
"""Paths relative to a deployment directory, and to the top of the source tree."""

PACKAGED_DIR = "deployment_files"
"""The folder of the package (no ``__init__.py``: data, not modules) that holds the wheel's copies."""


def source(name: str) -> Path | None:
    """The shipped copy of ``name`` (one of :data:`FILES`): the wheel's, else the checkout's; None when
    neither exists (a build that left it out)."""
    here = Path(__file__).resolve().parents[1]  # the package folder
    for path in (here / PACKAGED_DIR / name, here.parent / name):
        if path.is_file():
            return path
    return None


def write(directory: str | Path, force: bool = False) -> list[Path]:
    """Write every file of :data:`FILES` under ``directory`` (created with its parents when missing).

    Args:
        directory: the deployment directory.
        force: overwrite files that exist; without it an existing file stops the whole write.
    Returns:
        the paths written, in :data:`FILES` order.
    Raises:
        FileExistsError: a file exists and ``force`` is false (nothing was written); its ``filename``
            is the first such path.
        FileNotFoundError: the package lacks a file (a broken build).
        NotADirectoryError: ``directory`` (or a folder on the way) is a file.
    """
    root = Path(directory)
    sources = {}
    for name in FILES:
        src = source(name)
        if src is None:
            raise FileNotFoundError(2, "the package ships no copy of it", name)
        sources[name] = src
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(20, "not a directory", str(root))
    if not force:
        for name in FILES:
            if (root / name).exists():
                raise FileExistsError(17, "exists", str(root / name))
    out = []
    for name, src in sources.items():
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read_bytes())
        out.append(dest)
    return out

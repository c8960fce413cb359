"""Packaging glue that pyproject.toml cannot express: ship the top-level ``lua/`` folder as ``magpie.lua``.

``lua/`` stays the one home of every Redis script (next to the package, as the layout in docs/design.md
shows); the wheel carries it as the package ``magpie.lua``, read with ``importlib.resources``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["magpie", "magpie.*"]) + ["magpie.lua"],
    package_dir={"magpie.lua": "lua"},
)

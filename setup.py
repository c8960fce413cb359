"""Packaging glue that pyproject.toml cannot express.

- Ship the top-level ``lua/`` folder as ``magpie.lua``: ``lua/`` stays the one home of every Redis
  script (next to the package, as the layout in docs/design.md shows); the wheel carries it as the
  package ``magpie.lua``, read with ``importlib.resources``.
- Copy the deployment files (Procfile, Celery and Flower settings, ``alembic.ini``, the Prometheus rules
  and the Grafana dashboard; the list is :data:`magpie.base.deployment.FILES`) into the wheel under
  ``magpie/deployment_files/``, where ``magpie init`` and the Celery app find them.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _deployment():
    spec = importlib.util.spec_from_file_location("_magpie_deployment", HERE / "magpie" / "base" / "deployment.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildWithDeploymentFiles(build_py):
    """build_py, then the deployment files copied into the built package."""

    def run(self):
        super().run()
        dep = _deployment()
        for name in dep.FILES:
            dest = Path(self.build_lib) / "magpie" / dep.PACKAGED_DIR / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / name, dest)


setup(
    packages=find_packages(include=["magpie", "magpie.*"]) + ["magpie.lua"],
    package_dir={"magpie.lua": "lua"},
    cmdclass={"build_py": BuildWithDeploymentFiles},
)

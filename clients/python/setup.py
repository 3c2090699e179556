"""Build hook of calmq-client: of each package, only the modules pyproject.toml lists."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_CONFIG = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text("utf-8"))
MODULES = frozenset(_CONFIG["tool"]["calmq-client"]["modules"])


class ClientModulesOnly(build_py):
    """setuptools takes every module of a listed package; the client needs a few of each."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        return [(pkg, mod, path) for pkg, mod, path in found
                if (pkg if mod == "__init__" else f"{pkg}.{mod}") in MODULES]


setup(cmdclass={"build_py": ClientModulesOnly})

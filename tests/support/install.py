"""Build calmq's distributions and install them into fresh virtualenvs, as a user would.

Nothing here uses the checkout at run time: the sources are copied out (the files the
Dockerfile copies), the wheel is built from that copy with build isolation (so setuptools
is the version pyproject.toml asks for, not the shared venv's), and the programs run with
PYTHONPATH and every CALMQ_ variable removed, from a folder outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "build_wheel", "clean_env", "make_venv", "pip_names"]

ROOT = Path(__file__).resolve().parents[2]

# What the Dockerfile's build stage copies: the wheel must not need anything else.
_SOURCES = ("pyproject.toml", "README.md", "calmq", "producers", "relay", "processors",
            "schemas")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH, virtualenv markers or CALMQ_ settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CALMQ_") and k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                         "PYTHONHOME")}
    env.update(extra)
    return env


def _run(argv: list[str], *, cwd: Path, timeout: float) -> str:
    done = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _copy_sources(names: tuple[str, ...], source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for name in names:
        src = source / name
        if src.is_dir():
            # symlinks=True: calmq/producers -> ../producers stays a link, as in the checkout,
            # and resolves inside the copy.
            shutil.copytree(src, target / name, symlinks=True, ignore=_IGNORE)
        else:
            shutil.copy2(src, target / name)


def build_wheel(tmp: Path, project: str = ".") -> Path:
    """The wheel of ``project`` (a folder of the repository with a pyproject.toml)."""
    src = tmp / "src"
    # A sub-project (clients/python) reaches the kernel through links relative to the
    # repository, so the copy keeps the repository's shape around it.
    extra = () if project == "." else (project.split("/", maxsplit=1)[0],)
    _copy_sources((*_SOURCES, *extra), ROOT, src)
    where = src / project
    out = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
          str(out), str(where)], cwd=tmp, timeout=240)
    (wheel,) = out.glob("*.whl")
    return wheel


def make_venv(path: Path, *requirements: str) -> Path:
    """A fresh virtualenv at ``path`` with ``requirements`` installed; returns its bin/."""
    _run([sys.executable, "-m", "venv", str(path)], cwd=path.parent, timeout=120)
    bin_dir = path / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *requirements],
         cwd=path.parent, timeout=600)
    return bin_dir


def pip_names(bin_dir: Path) -> set[str]:
    """The distributions installed in the venv, normalised (lower case, ``-`` for ``_``)."""
    out = _run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "freeze"],
               cwd=bin_dir.parent, timeout=120)
    return {line.split("==")[0].lower().replace("_", "-")
            for line in out.splitlines() if "==" in line}

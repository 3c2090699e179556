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

__all__ = ["ROOT", "build_wheel", "build_wheels", "clean_env", "make_venv", "pip_names"]

ROOT = Path(__file__).resolve().parents[2]

# What the Dockerfile's build stage copies: the wheels must not need anything else (calmq's,
# and calmq-client's, which calmq requires and which no index has).
_SOURCES = ("pyproject.toml", "README.md", "calmq", "producers", "relay", "processors",
            "schemas", "clients/python")
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
    """The wheel of ``project`` (a folder of the repository with a pyproject.toml), in
    ``tmp/wheels``: the wheels of one ``tmp`` sit together, for ``make_venv``'s
    ``find_links``."""
    src = tmp / "src"
    if not src.exists():
        _copy_sources(_SOURCES, ROOT, src)
    out = tmp / "wheels"
    before = set(out.glob("*.whl"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir",
          str(out), str(src / project)], cwd=tmp, timeout=240)
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


def build_wheels(tmp: Path) -> tuple[Path, Path]:
    """calmq's wheel and calmq-client's, which calmq requires: install calmq's with
    ``find_links=wheel.parent``, as the Dockerfile does."""
    return build_wheel(tmp), build_wheel(tmp, "clients/python")


def make_venv(path: Path, *requirements: str, find_links: Path | None = None) -> Path:
    """A fresh virtualenv at ``path`` with ``requirements`` installed; returns its bin/.
    ``find_links``: a folder of wheels pip takes distributions from besides the index (the
    calmq-client wheel, which no index has)."""
    _run([sys.executable, "-m", "venv", str(path)], cwd=path.parent, timeout=120)
    bin_dir = path / "bin"
    links = [] if find_links is None else ["--find-links", str(find_links)]
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *links, *requirements],
         cwd=path.parent, timeout=600)
    return bin_dir


def pip_names(bin_dir: Path) -> set[str]:
    """The distributions installed in the venv, normalised (lower case, ``-`` for ``_``)."""
    out = _run([str(bin_dir / "python"), "-m", "pip", "list", "--format", "freeze"],
               cwd=bin_dir.parent, timeout=120)
    return {line.split("==")[0].lower().replace("_", "-")
            for line in out.splitlines() if "==" in line}

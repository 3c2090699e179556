"""The Dockerfile's steps, run as CI would run them without a Docker engine: the base image
pinned to a patch release of the Python this test runs, the sources it copies built into
calmq's wheel and calmq-client's, and in a clean virtualenv `pip install --no-deps -r
requirements.lock`, the wheels with --no-deps, `pip check`, then the installed `calmq`
renders the manifests (the alert rules and the dashboard are package data) and prints its
version.

It installs from PyPI (about 30 s, pip's cache makes it quicker), so it is one test.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import calmq
from tests.support.install import _SOURCES, ROOT, build_wheels, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_base_image_and_the_dependencies_are_pinned() -> None:
    """FROM a python image at a patch release (or a digest) of the lock's Python; every
    dependency of pyproject.toml pinned in requirements.lock with == and a sha256 the
    Dockerfile requires."""
    instructions = _instructions()
    [base] = [a for i, a in instructions if i == "ARG" and a.startswith("PYTHON_IMAGE=")]
    image = base.removeprefix("PYTHON_IMAGE=")
    match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-[a-z-]+(@sha256:[0-9a-f]{64})?", image)
    assert match, f"{image}: not a patch release"
    assert [a for i, a in instructions if i == "FROM"] == ["${PYTHON_IMAGE} AS build",
                                                           "${PYTHON_IMAGE}"]
    lock_python = re.search(r"Python (\d+)\.(\d+)", LOCK.read_text())
    assert lock_python, "requirements.lock names the Python it was made with"
    assert match.group(1, 2) == lock_python.group(1, 2)
    # A pin, then its hashes on continuation lines (indented).
    pins = {_name(line): line for line in LOCK.read_text().splitlines()
            if line and not line.startswith(("#", " "))}
    assert all("==" in line for line in pins.values()), pins
    hashed = re.findall(r"^(\S+==\S+) \\\n    --hash=sha256:[0-9a-f]{64}", LOCK.read_text(), re.M)
    assert sorted(hashed) == sorted(p.removesuffix(" \\") for p in pins.values()), \
        "every pin carries a hash"
    [run] = [a for i, a in instructions if i == "RUN" and "requirements.lock" in a]
    assert "--require-hashes" in run
    import tomllib

    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # calmq-client is built beside calmq's wheel from the checkout, never pinned from an index.
    assert sorted(_name(r) for r in wanted if _name(r) not in pins) == ["calmq-client"]
    assert "calmq-client" not in pins


def test_the_dockerfile_steps_install_the_lock_and_the_wheel(tmp_path: Path) -> None:
    """The build stage copies what the wheel needs; the runtime stage's RUN, replayed in a
    clean venv of this Python, installs the lock and the wheel, passes pip check, and the
    installed calmq works."""
    lock_python = re.search(r"Python (\d+)\.(\d+)", LOCK.read_text())
    assert lock_python
    if sys.version_info[:2] != tuple(int(v) for v in lock_python.group(1, 2)):
        pytest.skip(f"the lock is for Python {lock_python.group(1, 2)}; this is {sys.version}")
    instructions = _instructions()
    copied = {source for i, a in instructions if i == "COPY" and "--from" not in a
              for source in a.split()[:-1]}
    # The wheel is built from exactly what tests/support/install.py builds it from.
    assert copied - {"requirements.lock"} == set(_SOURCES)
    [run] = [a for i, a in instructions if i == "RUN" and "requirements.lock" in a]
    wheels = [str(w) for w in build_wheels(tmp_path)]
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    env = clean_env(PATH=f"{bin_dir}:/usr/bin:/bin", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for step in run.split("&&"):
        argv = shlex.split(step)
        if argv[:2] == ["pip", "install"] or argv[:2] == ["pip", "check"]:
            argv = [str(bin_dir / "pip"), *argv[1:]]
            argv = [w for a in argv for w in
                    ([str(LOCK)] if a == "/tmp/requirements.lock" else
                     wheels if a == "/wheels/*.whl" else [a])]
            done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True,
                                  text=True, timeout=600, check=False)
            assert done.returncode == 0, f"{step}:\n{done.stdout}\n{done.stderr}"
    version = subprocess.run([str(bin_dir / "calmq"), "--version"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False)
    assert version.stdout.strip() == f"calmq {calmq.__version__}", version.stderr
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": {"provider_url": "https://api.openai.com"},
                                      "monitoring": {"prometheusRule": {"enabled": True},
                                                     "dashboard": {"enabled": True}}}))
    rendered = subprocess.run([str(bin_dir / "calmq"), "k8s", "render", "-f", str(values),
                               "-o", "-"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, check=False)
    assert rendered.returncode == 0, rendered.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered.stdout) if d}
    assert {"PrometheusRule", "ConfigMap", "Deployment", "Job"} <= kinds

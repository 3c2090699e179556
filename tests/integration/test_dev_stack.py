"""`calmq dev up` where a part of it cannot start: the error names the fix, not a log file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import Stack, StackState

pytestmark = pytest.mark.integration


def test_dev_up_without_the_fake_extra_names_the_install_command(
        stack: StackState, tmp_path: Path) -> None:
    """Where the official SDKs are missing (a wheel installed without the `fake` extra),
    `calmq dev up` fails naming `pip install 'calmq[fake]'`, not only that the fake
    provider exited before it was ready."""
    shadow = tmp_path / "no-sdks"
    shadow.mkdir()
    for sdk in ("openai", "anthropic"):  # what an environment without the extra imports
        (shadow / f"{sdk}.py").write_text(f'raise ImportError("No module named {sdk}")\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(shadow), environ.get("PYTHONPATH", "")])
    # The session's database, broker and registry stand in for external ones: only the
    # fake provider is started here.
    environ.update({k: v for k, v in stack.env.items()
                    if k in ("CALMQ_DATABASE_URL", "CALMQ_KAFKA_BOOTSTRAP",
                             "CALMQ_SCHEMA_REGISTRY_URL")})
    dev = Stack(tmp_path / "stack", environ=environ)
    try:
        with pytest.raises(InfrastructureError) as failed:
            dev.up(services=("fake-provider",), log=lambda _m: None)
    finally:
        dev.down(log=lambda _m: None)
    assert "fake-provider exited before it was ready" in failed.value.message
    assert "pip install 'calmq[fake]'" in failed.value.message

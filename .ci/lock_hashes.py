"""`make lock`'s last step: requirements.lock with the sha256 of every wheel the image's pip
installs for each pin, on amd64 and arm64 (``pip install --require-hashes`` in the
Dockerfile). Arguments: the pins (``pip freeze``), then one folder of downloaded wheels per
architecture; the header comes on stdin."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock(pins: Path, folders: list[Path], header: str) -> str:
    hashes: dict[str, set[str]] = {}
    for folder in folders:
        for wheel in folder.iterdir():
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            hashes.setdefault(_norm(wheel.name.split("-")[0]), set()).add(digest)
    out = [header.rstrip("\n")]
    for line in pins.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        found = sorted(hashes.get(_norm(line.split("==")[0]), set()))
        if not found:
            raise SystemExit(f"no wheel for {line}: the image could not install it")
        out.append(f"{line} \\")
        out += [f"    --hash=sha256:{h}" + (" \\" if i < len(found) - 1 else "")
                for i, h in enumerate(found)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(lock(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]], sys.stdin.read()))

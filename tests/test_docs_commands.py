"""Every command README.md and docs/*.md print runs: as printed, or in its cheapest form.

The commands are collected from the docs themselves (fenced and indented code blocks, and
inline code spans), so a command added to a page is run here or this test fails naming
it. A `hal` command runs in its cheapest form: the tiny preset, one repetition, no warm-up,
a short timeout, outputs into a temporary folder (`cheap_form`). A `hal plan`
runs in this process, on the model's first 2 layers and at most 2 DP ranks. A command for an
accelerator (`VERL_DEVICE=cuda ...`) runs twice: as printed, where it must fail in one
line that names the backend (no traceback), and on the cpu backend in its cheap form.
Commands that are what CI itself runs, or that a test already runs in the same cheap form,
are listed in ELSEWHERE with the place that runs them, which this test checks exists.
Commands whose cheap forms are one run (the same options in another order or with sizes the
cheap form replaces, writing no more outputs: `hal bench` and `hal bench --json run.json`)
run once, under the command that covers the others (`runners`).
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_ASSIGNMENT = r"[A-Z_][A-Z0-9_]*=\S*"  # an environment variable set before a command
_ENV = r"(?:[A-Z_][A-Z0-9_]*=\S+\s+)*"
_PROGRAM = r"(?:\S*/)?(?:hal\s+(?:bench|demo|info|plan)|python3?\s+-m\s+hal\s+(?:bench|demo|info|plan)|make|bash\s+ci/\S+)"
_COMMAND = re.compile(rf"^{_ENV}{_PROGRAM}(?:\s|$)")


def _commands_of(text: str) -> list[str]:
    found = []
    in_block = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_block = not in_block
            continue
        if in_block or line.startswith("    "):
            command = re.split(r"\s+#\s", stripped)[0].strip()  # drop a trailing comment
            if _COMMAND.match(command):
                found.append(command)
        if not in_block:
            found.extend(span.strip() for span in re.findall(r"`([^`]+)`", line) if _COMMAND.match(span.strip()))
    return found


def documented_commands() -> dict[str, list[str]]:
    """Every command shown, with the pages that show it."""
    commands: dict[str, list[str]] = {}
    for page in PAGES:
        for command in _commands_of(page.read_text()):
            pages = commands.setdefault(command, [])
            if page.name not in pages:
                pages.append(page.name)
    return commands


# Commands run elsewhere, with where: CI runs the suite (`make test` is .ci/run), the demos
# run in tests/integrations (the same cheap form: few steps, engine in-process).
ELSEWHERE = {
    "make test": ".ci/run",
    "make test-cpu": "Makefile:test",
    "bash ci/cpu.sh": "Makefile:test-cpu",
    "bash ci/verl.sh": "Makefile:test-verl",
    "make demo": "tests/tools/test_demo.py::test_demo_runs_syncs_every_step_and_writes_plot_and_json",
    "hal demo": "tests/tools/test_demo.py::test_demo_runs_syncs_every_step_and_writes_plot_and_json",
    "hal demo --delta": "tests/tools/test_demo.py::test_demo_delta_engine_matches_trainer_after_every_delta_and_anchor_sync",
    "hal demo --canary-every 5": "tests/tools/test_demo.py::test_demo_prints_and_plots_the_canary_at_every_nth_sync",
    ".venv/bin/hal demo --delta": "tests/tools/test_demo.py::test_demo_delta_engine_matches_trainer_after_every_delta_and_anchor_sync",
    "make demo-ray": "tests/integrations/ray/test_ray.py::test_demo_ray_trains_fsdp2_actors_into_a_tp2_engine_actor",
    "hal demo --ray": "tests/integrations/ray/test_ray.py::test_demo_ray_trains_fsdp2_actors_into_a_tp2_engine_actor",
    # its cheap form there, whose report's bytes per engine worker it checks against each worker's shard
    "hal bench --engine vllm --engine-tp 2 --receive shard --vllm-methods hal,apply,floor --vllm-transports broadcast --json run.json":
        "tests/tools/test_bench_vllm_shard.py::test_the_bench_reports_each_worker_its_shard",
    # its cheap form there (tiny model, the engine multi-process), which checks the bytes per rank and per worker
    "hal bench --engine vllm --senders 2 --engine-tp 2 --receive shard --json run.json":
        "tests/tools/test_bench_vllm_senders.py::test_two_fsdp2_ranks_into_two_workers_report_and_check_each_workers_shard",
    "make test-vllm-versions": "Makefile:test-vllm-versions",  # 10 minutes with its environments built (docs/ci.md)
    "make test-megatron": "Makefile:test-megatron",  # the megatron lane, about 10 minutes (docs/ci.md)
    "bash ci/megatron.sh": "Makefile:test-megatron",
}

# Options whose value the cheap form replaces (None: dropped with its value).
_CHEAP_VALUES = {"--preset": "tiny", "--repeats": "1", "--warmup": "0", "--syncs": "2", "--timeout": "240", "--bucket-mb": "1",
                 "--segment-mb": "1", "--steps": "2", "--vllm-bucket-mb": "1",
                 # --engine vllm: the test suite's model, and a probe of 2 sequences of 4 tokens
                 "--vllm-preset": "tiny", "--vllm-canary": "2x4"}
_OUTPUTS = ("--json", "--plot", "--out-dir")
_HAL = re.compile(r"^(?:\S*/)?hal$")


def cheap_form(command: str, tmp: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a documented `hal`/`make`/`bash ci/...` command in its cheapest
    form: accelerator backends become cpu, virtualenv paths this machine's interpreter."""
    words = shlex.split(command)
    env = dict(os.environ)
    while words and re.fullmatch(_ASSIGNMENT, words[0]):
        name, _, value = words.pop(0).partition("=")
        if name == "VERL_DEVICE" and value in ("cuda", "npu"):
            value = "cpu"
        if name == "HAL_PYTHON":
            value = sys.executable
        env[name] = value
    if words[0] in ("make", "bash"):
        return words, env
    if _HAL.match(words[0]):
        args = words[1:]
    else:  # python -m hal ...
        args = words[words.index("-m") + 2 :]
    cheap: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if (word in _CHEAP_VALUES or word in _OUTPUTS) and args[0] != "info":  # `hal info --json` is a flag
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 2
            if word in _OUTPUTS:
                value = str(tmp / (f"out{len(cheap)}" + (pathlib.Path(value).suffix if "." in value else "")))
            else:
                value = _CHEAP_VALUES[word]
            cheap += [word, value]
            continue
        cheap.append(word)
        i += 1
    if args and args[0] == "bench":
        for option in ("--preset", "--repeats", "--warmup", "--timeout"):
            if option not in cheap and not (option == "--preset" and "--engine" in cheap):
                cheap += [option, _CHEAP_VALUES[option]]
        if "--delta" in cheap and "--syncs" not in cheap:
            cheap += ["--syncs", "2"]
        if "--delta-kernels" in cheap and "--segment-mb" not in cheap:
            cheap += ["--segment-mb", "1"]
        if "--engine" in cheap and "--vllm-in-process" not in cheap:
            cheap.append("--vllm-in-process")
        if "--engine" in cheap and "--vllm-preset" not in cheap:
            cheap += ["--vllm-preset", _CHEAP_VALUES["--vllm-preset"]]
    if args and args[0] == "plan":
        # the model's first 2 layers, an engine of at most 2 DP ranks and 2 copies: the same
        # layouts (TP, EP, the trainer) in a few seconds
        fewer = lambda m: f"{m.group(1)}={min(int(m.group(2)), 2)}"  # noqa: E731
        cheap = [re.sub(r"\b(dp|engines)=(\d+)", fewer, w) if i and cheap[i - 1] == "--engine" else w for i, w in enumerate(cheap)]
        if "--layers" not in cheap:
            cheap += ["--layers", "2"]
    if args and args[0] == "demo":
        for option, value in (("--steps", "2"), ("--out-dir", str(tmp / "demo"))):
            if option not in cheap:
                cheap += [option, value]
        if "--ray" not in cheap and "--in-process" not in cheap:
            cheap.append("--in-process")
    return [sys.executable, "-m", "hal", *cheap], env


def _for_hardware(command: str) -> bool:
    return bool(re.search(r"\bVERL_DEVICE=(cuda|npu)\b", command))


def _runnable() -> list[str]:
    return sorted(c for c in documented_commands() if c not in ELSEWHERE)


def _shape(command: str) -> tuple[tuple, frozenset[str]]:
    """What a command's cheap form runs, whatever the order of its options and wherever it
    writes: (the program, its options as sorted (option, values...) groups without the
    output options, the environment it sets, as printed), and the output options it writes."""
    argv, _ = cheap_form(command, pathlib.Path("/tmp"))
    words = shlex.split(command)
    setting = tuple(sorted(itertools.takewhile(lambda w: re.fullmatch(_ASSIGNMENT, w), words)))
    if argv[:3] != [sys.executable, "-m", "hal"]:
        return (tuple(argv), setting), frozenset()
    sub, groups, outputs = argv[3], [], set()
    for word in argv[4:]:
        if word.startswith("--"):
            groups.append([word])
        elif groups:
            groups[-1].append(word)
        else:
            sub += " " + word
    kept = []
    for group in groups:
        if group[0] in _OUTPUTS and sub != "info":  # `hal info --json` is a flag, not an output
            outputs.add(group[0])
        else:
            kept.append(tuple(group))
    return (sub, tuple(sorted(kept)), setting), frozenset(outputs)


def runners(commands: list[str]) -> dict[str, list[str]]:
    """The commands to run, each with the documented commands it covers (itself first): a
    command is covered by one that runs the same program with the same options (their order
    and sizes aside, as the cheap form shrinks them) and the same environment, and writes
    at least the same outputs (`hal bench --json run.json` covers `hal bench`)."""
    by_shape: dict[tuple, list[tuple[frozenset[str], str]]] = {}
    for command in commands:
        shape, outputs = _shape(command)
        by_shape.setdefault(shape, []).append((outputs, command))
    chosen: dict[str, list[str]] = {}
    for members in by_shape.values():
        picked: list[tuple[frozenset[str], str]] = []
        for outputs, command in sorted(members, key=lambda m: (-len(m[0]), m[1])):
            runner = next((c for o, c in picked if outputs <= o), None)
            if runner is None:
                picked.append((outputs, command))
                chosen[command] = [command]
            else:
                chosen[runner].append(command)
    return dict(sorted(chosen.items()))


def test_the_docs_print_commands_and_each_has_a_way_to_run():
    commands = documented_commands()
    assert len(commands) >= 30, f"only {len(commands)} commands found: the collector is broken"
    for command in commands:
        if command in ELSEWHERE:
            continue
        argv, _ = cheap_form(command, pathlib.Path("/tmp"))
        assert argv, command


def test_every_place_named_elsewhere_exists_and_every_entry_is_still_documented():
    documented = documented_commands()
    for command, place in ELSEWHERE.items():
        assert command in documented, f"ELSEWHERE lists {command!r}, which no page shows any more"
        path, _, name = place.partition("::")
        path, _, target = path.partition(":")
        text = (ROOT / path).read_text() if (ROOT / path).is_file() else "".join(p.read_text() for p in (ROOT / path).glob("*"))
        if name:
            assert re.search(rf"def {re.escape(name)}\b", text), f"{place} (for {command!r}) does not exist"
        if target:
            assert re.search(rf"^{re.escape(target)}:", text, re.M), f"{place} (for {command!r}) does not exist"
        if path == ".ci/run":
            assert command in text


@pytest.mark.parametrize("command", list(runners(_runnable())))
def test_documented_command_runs(command, tmp_path):
    argv, env = cheap_form(command, tmp_path)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if argv[3:4] == ["plan"]:
        # in this process, through the same `hal.cli.main`: vLLM's and transformers' imports
        # (~10 s here) are paid once for every documented plan, not once each
        from hal import cli

        assert cli.main(argv[3:]) == 0, f"{command!r} ran as {shlex.join(argv)}"
        return
    if _for_hardware(command) and argv[:3] == [sys.executable, "-m", "hal"]:
        # as printed: no such device here, so one line naming the backend, no traceback
        printed_env = dict(env, VERL_DEVICE=re.search(r"VERL_DEVICE=(\w+)", command).group(1))
        printed = subprocess.run(argv, env=printed_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        output = printed.stdout + printed.stderr
        assert "Traceback" not in output, f"{command!r} as printed:\n{output[-3000:]}"
        if printed.returncode != 0:
            assert printed_env["VERL_DEVICE"] in output, f"{command!r} as printed failed without naming the backend:\n{output[-3000:]}"
    done = subprocess.run(argv, env=env, cwd=tmp_path if argv[0] == sys.executable else ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in output, f"{command!r} ran as {shlex.join(argv)}, exit {done.returncode}:\n{output[-4000:]}"


def test_cheap_form_keeps_the_command_and_shrinks_only_its_size(tmp_path):
    argv, env = cheap_form("VERL_DEVICE=cuda .venv-cuda/bin/hal bench --device-transfer --preset qwen2.5-1.5b --receivers 2 --json d.json", tmp_path)
    assert env["VERL_DEVICE"] == "cpu"
    assert argv[3:] == ["bench", "--device-transfer", "--preset", "tiny", "--receivers", "2", "--json", str(tmp_path / "out6.json"),
                        "--repeats", "1", "--warmup", "0", "--timeout", "240"]
    argv, _ = cheap_form("hal plan --model m --trainer megatron:tp=4,dp=4 --engine tp=1,dp=64,ep --engine tp=8,engines=16 --json p.json", tmp_path)
    assert argv[3:] == ["plan", "--model", "m", "--trainer", "megatron:tp=4,dp=4", "--engine", "tp=1,dp=2,ep", "--engine", "tp=8,engines=2",
                        "--json", str(tmp_path / "out9.json"), "--layers", "2"]
    assert _commands_of("see `hal bench --delta` and\n```bash\nmake setup   # builds it\n```\n    hal info --json\n") == [
        "hal bench --delta", "make setup", "hal info --json"]


def test_a_command_is_covered_only_by_one_that_runs_the_same_options_and_writes_as_much():
    chosen = runners([
        "hal bench", "hal bench --json run.json",                                    # the same, one writes more
        "hal bench --receivers 2 --preset qwen2.5-0.5b", "hal bench --preset moe-16k --receivers 2",  # order, sizes
        "hal bench --senders 4 --receivers 3", "hal bench --senders 3 --receivers 4",  # other values
        "hal bench --plot p.png", "hal bench --json r.json --plot p.png",
        "VERL_DEVICE=cuda hal info", "VERL_DEVICE=cuda .venv-cuda/bin/hal info", "VERL_DEVICE=npu hal info",  # as printed: cuda, npu
        "hal info", "hal info --json",                                                # a flag of `hal info`, not an output
    ])
    assert chosen == {
        "hal bench --json r.json --plot p.png": ["hal bench --json r.json --plot p.png", "hal bench --json run.json", "hal bench --plot p.png", "hal bench"],
        "hal bench --preset moe-16k --receivers 2": ["hal bench --preset moe-16k --receivers 2", "hal bench --receivers 2 --preset qwen2.5-0.5b"],
        "hal bench --senders 3 --receivers 4": ["hal bench --senders 3 --receivers 4"],
        "hal bench --senders 4 --receivers 3": ["hal bench --senders 4 --receivers 3"],
        "VERL_DEVICE=cuda .venv-cuda/bin/hal info": ["VERL_DEVICE=cuda .venv-cuda/bin/hal info", "VERL_DEVICE=cuda hal info"],
        "VERL_DEVICE=npu hal info": ["VERL_DEVICE=npu hal info"],
        "hal info": ["hal info"],
        "hal info --json": ["hal info --json"],
    }
    # every documented command is run or covered, once
    documented = _runnable()
    covered = [c for group in runners(documented).values() for c in group]
    assert sorted(covered) == documented

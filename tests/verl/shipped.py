"""verl's own checkpoint-engine test helpers, as the verl 0.9.1 wheel ships them.

The wheel installs its tests as a top-level package named `tests` next to `verl`, which
this repository's own `tests` package shadows; so the helpers are loaded from their file
under another module name, and Ray is told to send their classes by value (the workers
then need not import them under either name).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE_NAME = "verl_shipped_checkpoint_engine_test_utils"


def verl_tests_dir() -> Path:
    """The `tests/` folder the verl wheel installed next to the `verl` package."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ImportError("verl is not installed (make setup-verl builds .venv-verl with verl 0.9.1)")
    return Path(spec.origin).resolve().parent.parent / "tests"


def test_utils() -> ModuleType:
    """verl's `tests/checkpoint_engine/test_utils.py` (TrainingWorkerTest, MockServerAdapter, ...)."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    path = verl_tests_dir() / "checkpoint_engine" / "test_utils.py"
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    return module

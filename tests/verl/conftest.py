"""The verl lane's one Ray instance, shared by its flows (tests/verl/flow.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def loopback_ray():
    """Ray on loopback for every flow of the lane, started at the first that asks; each
    flow checks at its end that it left no actor, process or placement group."""
    from tests.verl import flow

    with flow.loopback_ray():
        yield

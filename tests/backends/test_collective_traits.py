"""Collective traits are keyed by the collective library's name, not declared by a backend."""

from __future__ import annotations

import dataclasses

import pytest

import hal
from hal.backends.collectives import (
    CONSERVATIVE_TRAITS,
    CollectiveTraits,
    collective_traits,
    known_collective_libraries,
)


@pytest.mark.parametrize(
    ("name", "follows_streams", "point_to_point", "device_p2p"),
    [
        ("gloo", False, True, False),  # host threads: the host waits; ~1 ms per broadcast, so send/recv; host memory only
        ("nccl", True, False, True),  # ordered on the issuing stream; broadcasts not measured against
        ("hccl", True, False, True),
    ],
)
def test_table(name, follows_streams, point_to_point, device_p2p):
    for spelled in (name, name.upper(), f" {name.capitalize()} "):
        traits = collective_traits(spelled)
        assert traits == CollectiveTraits(
            follows_streams=follows_streams, point_to_point_for_one_receiver=point_to_point, point_to_point_device_memory=device_p2p
        )


def test_known_libraries():
    assert known_collective_libraries() == ("gloo", "hccl", "nccl")


@pytest.mark.parametrize("name", ["mpi", "ucc", "", "cuda:nccl,cpu:gloo", "nccl2"])
def test_unknown_names_get_the_conservative_traits(name):
    # follows_streams=False is always correct: the host waits before the collective.
    assert collective_traits(name) is CONSERVATIVE_TRAITS
    assert CONSERVATIVE_TRAITS == CollectiveTraits(follows_streams=False, point_to_point_for_one_receiver=False, point_to_point_device_memory=False)


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="dist_backend must be a str, got NoneType"):
        collective_traits(None)


def test_traits_are_frozen_and_keyword_only():
    traits = collective_traits("gloo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        traits.follows_streams = True
    with pytest.raises(TypeError):
        CollectiveTraits(True, False)


def test_no_backend_declares_collective_traits():
    for name in hal.backend_names():
        cls = hal.device.backend_class(name)
        assert not hasattr(cls, "collectives_follow_streams"), name
        assert not hasattr(cls, "point_to_point_transfers"), name


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_describe_shows_the_traits_of_the_dist_backend(name):
    described = hal.get_backend(name).describe()
    assert described["collective_traits"] == {"follows_streams": False, "point_to_point_for_one_receiver": True, "point_to_point_device_memory": False}

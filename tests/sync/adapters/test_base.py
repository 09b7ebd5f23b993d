"""The state-dict adapter contract (hal.sync.adapters.base): rules from names and shapes,
applied lazily by `adapt`, composed by `Chain` (each adapter given the names the one before
made), compared by what they map with (the steady state's key). The adapters here are
written for the test; each real one has its own file."""

from __future__ import annotations

import pytest
import torch

from hal.sync.adapters import Chain, Derived, NameAdapter, Rename, StateDictAdapter, Unwrap, adapt
from hal.sync.plan import Block


class Halves(StateDictAdapter):
    """Splits every tensor named in `names` into its two row halves, `<name>.0` and `<name>.1`."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.seen: list[list[str]] = []  # the names each `rules` call was given

    def rules(self, names, tensors):
        self.seen.append(list(names))
        return {n: _Halves(n) for n in names if n in self.names}


class _Halves(Derived):
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def apply(self, tensor):
        return [(f"{self.name}.{i}", half) for i, half in enumerate(tensor.chunk(2))]


class Doubled(StateDictAdapter):
    """Computes: every tensor twice its value (a stand-in for a merge). Counts its computations."""

    views = False

    def __init__(self) -> None:
        self.computed = 0

    def rules(self, names, tensors):
        return {n: _Doubled(self) for n in names}


class _Doubled(Derived):
    __slots__ = ("owner",)
    views = False

    def __init__(self, owner: Doubled) -> None:
        self.owner = owner

    def apply(self, tensor):
        self.owner.computed += 1
        return [("doubled", tensor * 2)]

    def layout(self, tensor):
        return [("doubled", tensor)]


class Upper(NameAdapter):
    def name(self, name):
        return None if name.startswith("drop") else name.upper()


def pairs() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.arange(4.0)), ("b", torch.arange(6.0).view(2, 3)), ("drop", torch.zeros(1))]


def test_a_name_adapter_is_applied_per_name_and_leaves_tensors_as_they_are():
    ps = pairs()
    out = Upper().to_checkpoint(ps)
    assert [n for n, _ in out] == ["A", "B"]
    assert out[0][1] is ps[0][1] and out[1][1] is ps[1][1]
    rules = Upper().rules(["a", "drop", "A"], [])
    assert set(rules) == {"a", "drop"} and rules["a"].name == "A" and rules["drop"].name is None


def test_a_derived_rule_makes_views_and_whole_and_split_say_what_each_is_given():
    ps = pairs()
    given = []
    out = list(adapt(ps, Halves("b"), whole=lambda t: ("whole", t), split=lambda n, t: given.append(n) or t))
    assert [n for n, _ in out] == ["a", "b.0", "b.1", "drop"]
    assert out[0][1][0] == "whole" and given == ["b"]
    assert out[1][1].data_ptr() == ps[1][1].data_ptr() and torch.equal(out[2][1], ps[1][1][1:])


def test_a_chain_gives_each_adapter_the_names_the_one_before_made():
    halves = Halves("B")
    chain = Chain(Upper(), halves, Rename(lambda n: None if n.endswith(".1") else f"x.{n}"))
    ps = pairs()
    out = chain.to_checkpoint(ps)
    assert halves.seen == [["A", "B"]]  # the dropped tensor is gone before the second adapter
    assert [n for n, _ in out] == ["x.A", "x.B.0"]
    assert out[0][1] is ps[0][1] and torch.equal(out[1][1], ps[1][1][:1])
    # the composite rules, keyed by the first adapter's input names
    rules = chain.rules([n for n, _ in ps], [t for _, t in ps])
    assert rules["a"].name == "x.A" and rules["drop"].name is None and not rules["b"].whole


def test_a_chain_of_name_adapters_is_one_function_and_flattens():
    chain = Chain(Unwrap(), None, Chain(Upper(), Rename(str.lower)))
    assert len(chain.adapters) == 3
    rename = chain.name_function()
    assert rename("l._orig_mod.w") == "l.w" and rename("drop.x") is None
    assert Chain(Unwrap()).name_function() is Unwrap().name_function()  # no wrapper frame for one
    assert Chain(Unwrap(), Halves("x")).name_function() is None
    with pytest.raises(TypeError, match="Chain: function is not a StateDictAdapter"):
        Chain(lambda n: n)


def test_adapters_compare_by_what_they_map_with():
    f = str.lower
    assert Chain(Unwrap(), Rename(f)) == Chain(Unwrap(), Rename(f))  # made anew each sync: the same kind
    assert Chain(Unwrap(), Rename(f)) != Chain(Unwrap(), Rename(str.upper))
    assert Chain(Unwrap(), Rename(f)) != Chain(Unwrap())
    assert Chain(Unwrap(), Rename(lambda n: n)) != Chain(Unwrap(), Rename(lambda n: n))  # two functions: two renames


def test_layout_reads_no_bytes_of_what_an_adapter_computes():
    doubled = Doubled()
    ps = [("a", torch.ones(3))]
    assert not Chain(Unwrap(), doubled).views and Chain(Unwrap(), Halves()).views
    assert [(n, t.shape) for n, t in adapt(ps, Chain(Unwrap(), doubled), layout=True)] == [("doubled", (3,))]
    assert doubled.computed == 0
    assert torch.equal(dict(adapt(ps, Chain(Unwrap(), doubled)))["doubled"], torch.full((3,), 2.0))
    assert doubled.computed == 1
    # in a chain, what it computes is computed once per read, and a later adapter renames it
    out = Chain(doubled, Halves("doubled")).to_checkpoint([("a", torch.arange(4.0))])
    assert [n for n, _ in out] == ["doubled.0", "doubled.1"] and doubled.computed == 2


def test_a_chain_plans_on_stand_ins_without_a_gather():
    class Gathering(torch.Tensor):  # a tensor subclass: its bytes are not read while planning
        pass

    ps = [("b", torch.arange(4.0).as_subclass(Gathering))]
    halves = Halves("b.0")
    chain = Chain(Halves("b"), halves)
    rules = chain.rules(["b"], [ps[0][1]])
    assert halves.seen == [["b.0", "b.1"]] and not rules["b"].whole
    out = list(adapt(ps, chain, split=lambda n, t: t.as_subclass(torch.Tensor)))
    assert [n for n, _ in out] == ["b.0.0", "b.0.1", "b.1"]


def test_a_block_is_renamed_but_never_split_again():
    class Blocks(StateDictAdapter):
        def rules(self, names, tensors):
            return {n: _Block() for n in names}

    class _Block(Derived):
        __slots__ = ()

        def apply(self, tensor):
            return [("w", Block(tensor, (8,), (4,)))]

    out = Chain(Blocks(), Rename(lambda n: f"model.{n}")).to_checkpoint([("x", torch.zeros(4))])
    assert out[0][0] == "model.w" and isinstance(out[0][1], Block)
    with pytest.raises(ValueError, match="tensor 'w': Block made by one adapter cannot be split again"):
        Chain(Blocks(), Halves("w")).to_checkpoint([("x", torch.zeros(4))])

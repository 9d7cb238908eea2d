"""declared_order: parts sorted by runs_before/runs_after, ties by name; contradictions refused."""

import dataclasses

import pytest

from tvm_fusion.errors import PluginError
from tvm_fusion.ordering import declared_order


@dataclasses.dataclass
class Part:
    name: str
    runs_before: tuple = ()
    runs_after: tuple = ()


def names(parts):
    return [p.name for p in declared_order(parts, "pattern")]


def test_ties_are_broken_by_name_and_declarations_win():
    assert names([Part("c"), Part("a"), Part("b")]) == ["a", "b", "c"]
    assert names([Part("a", runs_after=("c",)), Part("b"), Part("c")]) == ["b", "c", "a"]
    assert names([Part("a"), Part("z", runs_before=("a",))]) == ["z", "a"]


def test_star_runs_after_every_part_that_does_not_say_so():
    parts = [Part("fallback", runs_after=("*",)), Part("generic", runs_after=("*",), runs_before=("fallback",)),
             Part("zeta"), Part("alpha")]
    assert names(parts) == ["alpha", "zeta", "generic", "fallback"]


def test_star_runs_before_every_part_that_does_not_say_so():
    parts = [Part("zeta"), Part("first", runs_before=("*",)), Part("second", runs_before=("*",), runs_after=("first",)),
             Part("alpha"), Part("fallback", runs_after=("*",))]
    assert names(parts) == ["first", "second", "alpha", "zeta", "fallback"]
    with pytest.raises(PluginError, match="contradicts itself"):
        declared_order([Part("a", runs_before=("*",)), Part("b", runs_before=("a",))], "pattern")


def test_a_circle_is_refused_naming_its_parts():
    parts = [Part("a", runs_before=("b",)), Part("b", runs_before=("c",)), Part("c", runs_before=("a",)), Part("d")]
    with pytest.raises(PluginError, match="contradicts itself: a -> b -> c -> a"):
        declared_order(parts, "pattern")


def test_unknown_names_and_duplicates_are_refused():
    with pytest.raises(PluginError, match="'a' runs_after 'nope', which is not a registered pattern"):
        declared_order([Part("a", runs_after=("nope",))], "pattern")
    with pytest.raises(PluginError, match="two patterns are named 'a'"):
        declared_order([Part("a"), Part("a")], "pattern")


def test_names_ordered_elsewhere_are_skipped():
    assert names_elsewhere([Part("a", runs_after=("other_phase",))]) == ["a"]


def names_elsewhere(parts):
    return [p.name for p in declared_order(parts, "pattern", elsewhere=frozenset({"other_phase"}))]

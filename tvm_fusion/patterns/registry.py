"""The pattern registry: every pattern module in this package, plus the ``tvm_fusion.patterns``
entry points of installed plugins, in the order they declare.

A pattern is found by its module alone (one class with a ``name`` per file here, or an entry
point naming the class), so adding one touches no list. Rewrites run before fusions (they are
separate pipeline phases); within each, ``runs_before``/``runs_after`` set the order, where two
fusions match at one place the earlier one takes it.
"""

from __future__ import annotations

import functools
import importlib

from ..errors import PluginError
from ..ordering import declared_order
from ..plugins import classes_defined_in, plugin_rules
from .base import FusionRule, RewriteRule

ENTRY_POINT_GROUP = "tvm_fusion.patterns"
Rule = RewriteRule | FusionRule


@functools.cache
def pattern_registry() -> dict[str, Rule]:
    """Name -> rule for every registered pattern, in pipeline order: rewrites, then fusions."""
    rules = [*builtin_rules(), *plugin_rules(ENTRY_POINT_GROUP, (RewriteRule, FusionRule))]
    names = [rule.name for rule in rules]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        origins = " and ".join(f"{type(r).__module__}.{type(r).__qualname__}" for r in rules if r.name == twice)
        raise PluginError(f"two patterns are named {twice!r}: {origins}", "rename one of them (names must be unique)")
    rewrites = [rule for rule in rules if isinstance(rule, RewriteRule)]
    fusions = [rule for rule in rules if isinstance(rule, FusionRule)]
    _check_phase_order(rewrites, fusions)
    ordered = [*declared_order(rewrites, "pattern", elsewhere=frozenset(r.name for r in fusions)),
               *declared_order(fusions, "pattern", elsewhere=frozenset(r.name for r in rewrites))]
    return {rule.name: rule for rule in ordered}


def builtin_rules() -> list[Rule]:
    """One instance of each named pattern class defined in a module of this package."""
    package = importlib.import_module(__package__)
    return [cls() for cls in classes_defined_in(package, (RewriteRule, FusionRule)) if cls.name]


def _check_phase_order(rewrites: list[Rule], fusions: list[Rule]) -> None:
    """No fusion may run before a rewrite, nor a rewrite after a fusion: rewrites are an earlier
    pipeline phase (canonicalize), whatever a declaration says."""
    rewrite_names, fusion_names = {r.name for r in rewrites}, {r.name for r in fusions}
    for rules, relation, others in ((fusions, "runs_before", rewrite_names), (rewrites, "runs_after", fusion_names)):
        for rule in rules:
            for name in set(getattr(rule, relation, ())) & others:
                raise PluginError(f"pattern {rule.name!r} {relation} {name!r}, but rewrites always run before "
                                  "fusions (the canonicalize phase)", f"drop {name!r} from {rule.name!r}'s {relation}")

"""Order the parts of a registry (fusion patterns, schedule rules) by what each one declares.

Each part names the parts it must run before (``runs_before``) or after (``runs_after``) and the
registry sorts them so that every declaration holds, ties broken by name, so a new part slots in
without anyone editing a central list. ``"*"`` in ``runs_after`` means after every part that does
not say so itself (a rule that answers for anything, like a fallback); in ``runs_before``, before
every part that does not say so itself (a rule that must see its kernels before any other
touches them). A contradiction (a circle of declarations) or a declaration naming no registered
part is refused, naming the parts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TypeVar

from .errors import PluginError

Part = TypeVar("Part")
EVERY_OTHER = "*"


def declared_order(parts: Sequence[Part], kind: str, name_of: Callable[[Part], str] = lambda p: p.name,
                   elsewhere: frozenset[str] = frozenset()) -> list[Part]:
    """``parts`` sorted so that each one's ``runs_before``/``runs_after`` hold, ties by name.

    ``elsewhere``: names of parts ordered in another list (another phase); declarations naming
    them are the caller's to check and are skipped here.
    """
    by_name: dict[str, Part] = {}
    for part in parts:
        name = name_of(part)
        if name in by_name:
            raise PluginError(f"two {kind}s are named {name!r}: {_origin(by_name[name])} and {_origin(part)}",
                              "rename one of them (names must be unique)")
        by_name[name] = part
    edges: dict[str, set[str]] = {name: set() for name in by_name}  # name -> the parts after it
    for name, part in by_name.items():
        before, after = getattr(part, "runs_before", ()), getattr(part, "runs_after", ())
        for other, other_part in by_name.items():
            if EVERY_OTHER in after and EVERY_OTHER not in getattr(other_part, "runs_after", ()):
                edges[other].add(name)
            if EVERY_OTHER in before and EVERY_OTHER not in getattr(other_part, "runs_before", ()):
                edges[name].add(other)
        declared = [("runs_before", later, (name, later)) for later in before if later != EVERY_OTHER]
        declared += [("runs_after", earlier, (earlier, name)) for earlier in after if earlier != EVERY_OTHER]
        for relation, other, (first, then) in declared:
            if other in by_name:
                edges[first].add(then)
            elif other not in elsewhere:  # a name ordered in another list is the caller's to check
                raise PluginError(f"{kind} {name!r} {relation} {other!r}, which is not a registered {kind}",
                                  f"fix the name in {name!r}'s {relation} (registered: {', '.join(sorted(by_name))})")
    waiting = {name: 0 for name in by_name}
    for targets in edges.values():
        for target in targets:
            waiting[target] += 1
    ready = [name for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        name = heapq.heappop(ready)
        ordered.append(name)
        for target in edges[name]:
            waiting[target] -= 1
            if waiting[target] == 0:
                heapq.heappush(ready, target)
    if len(ordered) < len(by_name):
        circle = _circle({n: t for n, t in edges.items() if n not in ordered})
        raise PluginError(f"the {kind}s' declared order contradicts itself: {' -> '.join(circle)}",
                          "drop or reverse one of these runs_before/runs_after declarations")
    return [by_name[name] for name in ordered]


def _circle(edges: dict[str, set[str]]) -> list[str]:
    """One circle in a graph where every node is on or leads to one: walk until a node repeats."""
    path, node = [], min(edges)
    while node not in path:
        path.append(node)
        node = min(t for t in edges[node] if t in edges)
    return [*path[path.index(node):], node]


def _origin(part) -> str:
    return f"{type(part).__module__}.{type(part).__qualname__}"

"""Runs of identical blocks in the fused graph (transformer layers, repeated conv stages), so that a
.png or .svg can draw each run once, framed, with its count, instead of a poster of copies."""

from __future__ import annotations

import collections

from .model import Graph


def find_repeats(graph: Graph, min_period: int = 3) -> list[tuple[int, int, int]]:
    """(start, period, count) of runs of identical consecutive blocks of boxes, largest saving
    first, not overlapping: same texts box by box, the same edges inside each block, each block
    connected and reading the one before it (layers in sequence, not parallel branches that
    happen to look alike, such as an FPN's levels)."""
    texts = [tuple(box.lines) for box in graph.boxes]
    parents = collections.defaultdict(set)
    for a, b in graph.edges:
        parents[b].add(a)
    count = len(texts)

    def inner(start: int, period: int) -> tuple:
        """The block's own edges, relative to its start; edges from outside it are not compared."""
        return tuple(sorted((p - start, b - start) for b in range(start, start + period)
                            for p in parents[b] if start <= p < start + period))

    runs = []
    taken: set[int] = set()
    while True:
        best = None
        for start in range(count):
            for period in range(min_period, (count - start) // 2 + 1):
                if texts[start] != texts[start + period] or texts[start:start + period] != texts[
                        start + period:start + 2 * period]:
                    continue
                shape, repeats = inner(start, period), 1
                if not _connected(period, shape):
                    continue
                while (start + (repeats + 1) * period <= count
                       and texts[start:start + period] == texts[start + repeats * period:start + (repeats + 1) * period]
                       and inner(start + repeats * period, period) == shape
                       and _follows(parents, start + (repeats - 1) * period, start + repeats * period, period)):
                    repeats += 1
                span = set(range(start, start + repeats * period))
                if repeats > 1 and not span & taken and (best is None or (repeats - 1) * period > best[0]):
                    best = ((repeats - 1) * period, start, period, repeats)
        if best is None:
            return sorted(runs)
        _, start, period, repeats = best
        runs.append((start, period, repeats))
        taken |= set(range(start, start + repeats * period))


def _follows(parents: dict, before: int, after: int, period: int) -> bool:
    """True if the block at ``after`` reads the block at ``before`` and nothing before it reads
    the block at ``after`` (in sequence, not a chain running the other way through the copies)."""
    reads = any(before <= p < after for b in range(after, after + period) for p in parents[b])
    read_back = any(after <= p < after + period for b in range(after) for p in parents[b])
    return reads and not read_back


def _connected(count: int, edges: tuple) -> bool:
    """True if ``edges`` (between 0..count-1) join all of 0..count-1, directions ignored."""
    reached, frontier = {0}, [0]
    while frontier:
        box = frontier.pop()
        for a, b in edges:
            for here, there in ((a, b), (b, a)):
                if here == box and there not in reached:
                    reached.add(there)
                    frontier.append(there)
    return len(reached) == count


def fold_repeats(graph: Graph) -> Graph:
    """The graph with each run of identical blocks drawn once: edges of the later copies go to
    the first; edges from one copy to the next are left out (the frame says it repeats)."""
    runs = find_repeats(graph)
    if not runs:
        return graph
    target, copy_of = {}, {}
    for start, period, repeats in runs:
        for box in range(start, start + period * repeats):
            target[box] = start + (box - start) % period
            copy_of[box] = (start, (box - start) // period)
    kept = [box for box in range(len(graph.boxes)) if target.get(box, box) == box]
    renumber = {box: new for new, box in enumerate(kept)}
    edges = set()
    for a, b in graph.edges:
        if a in copy_of and b in copy_of and copy_of[a][0] == copy_of[b][0] and copy_of[a][1] != copy_of[b][1]:
            continue
        edge = (renumber[target.get(a, a)], renumber[target.get(b, b)])
        if edge[0] != edge[1]:
            edges.add(edge)
    frames = [([renumber[box] for box in range(start, start + period)], repeats) for start, period, repeats in runs]
    return Graph([graph.boxes[box] for box in kept], sorted(edges), graph.folded_nodes, frames)

"""A local search over whole GPUs: move GPUs to the model furthest behind from those that can spare them.

The pool-sizing MILP's only coupling between models is the GPU count per type, and on large
fleets its solvers spend the time limit without improving a plan much. Here each model's share is
an integer GPU count per type, valued by a fast greedy: its best configuration on those GPUs, then
the best one of another route on the GPUs left over, and so on. One move gives the model with the
lowest throughput / weight one GPU (or two, for a pipeline that needs both types) taken from free
GPUs or from models that stay above it after the loss; the search stops when no move helps it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import Callable, Mapping, Sequence

import numpy as np

from daskpipe.plan.configs import Config

Allocation = tuple[int, ...]  # whole GPUs per type, in the order of the cluster's types
Pipelines = tuple[tuple[Config, tuple[int, ...]], ...]  # (configuration, vGPUs per pool)

MAX_PIPELINES = 4
"""Pipelines the greedy valuation stacks per model: each takes what the earlier ones leave over."""


BUNDLE_SIZES = (1, 2, 3)
"""GPUs one move gives the model furthest behind: three let a pipeline over two types grow by a step."""


@dataclass(frozen=True)
class Share:
    """A model's GPUs per type and what the greedy valuation serves on them."""

    gpus: Allocation
    throughput: float
    pipelines: Pipelines


class Valuation:
    """One model's throughput on a given allocation, cached: the configurations as arrays over pools."""

    def __init__(self, configs: Sequence[Config], types: Sequence[str]):
        self.index = index = {g: k for k, g in enumerate(types)}
        # configurations with two pools on one GPU type would need a split of its GPUs: left to the MILP
        self.configs = [c for c in configs if len({g for g, _ in c.resources}) == len(c.resources)]
        parts = max((c.num_parts for c in self.configs), default=1)
        shape = (len(self.configs), parts)
        self.type_of = np.zeros(shape, dtype=int)
        self.per_gpu = np.zeros(shape)  # req/s one whole GPU gives the pool (v slices of it)
        self.pool = np.zeros(shape, dtype=bool)  # False where a configuration has fewer pools
        for i, c in enumerate(self.configs):
            for d, ((gpu, v), throughput) in enumerate(zip(c.resources, c.vgpu_throughput)):
                self.type_of[i, d], self.per_gpu[i, d], self.pool[i, d] = index[gpu], v * throughput, True
        self.routes = [tuple(g for g, _ in c.resources) for c in self.configs]
        self.cache: dict[Allocation, Share] = {}

    def __call__(self, gpus: Allocation) -> Share:
        if gpus not in self.cache:
            self.cache[gpus] = self._greedy(gpus)
        return self.cache[gpus]

    def without(self, share: Share, k: int) -> Share:
        """``share`` on one GPU of type ``k`` fewer: its pipelines, the pool on ``k`` that loses the
        least giving up one GPU's slices, or the greedy valuation if that serves more (or if
        ``share`` does not list its pipelines, as a start may not)."""
        fewer = tuple(n - (j == k) for j, n in enumerate(share.gpus))
        greedy = self(fewer)
        if not share.pipelines:
            return greedy
        on: dict[tuple[str, int], int] = {}
        for c, vgpus in share.pipelines:
            for r, n in zip(c.resources, vgpus):
                on[r] = on.get(r, 0) + n
        if sum(math.ceil(n / v) for (gpu, v), n in on.items() if self.index[gpu] == k) <= fewer[k]:
            return max(greedy, Share(fewer, share.throughput, share.pipelines), key=lambda s: s.throughput)
        best: tuple[float, int, tuple[int, ...]] | None = None
        for i, (c, vgpus) in enumerate(share.pipelines):
            before = min(n * x for n, x in zip(vgpus, c.vgpu_throughput))
            for d, ((gpu, v), n) in enumerate(zip(c.resources, vgpus)):
                spared = on[(gpu, v)] - (math.ceil(on[(gpu, v)] / v) - 1) * v  # slices that free one GPU
                if self.index[gpu] != k or n < spared:
                    continue
                smaller = vgpus[:d] + (n - spared,) + vgpus[d + 1 :]
                loss = before - min(n * x for n, x in zip(smaller, c.vgpu_throughput))
                if best is None or loss < best[0]:
                    best = (loss, i, smaller)
        if best is None or share.throughput - best[0] <= greedy.throughput:
            return greedy
        loss, i, smaller = best
        pipelines = list(share.pipelines)
        pipelines[i] = (pipelines[i][0], smaller)
        kept = tuple(p for p in pipelines if min(p[1]) > 0)
        return Share(fewer, share.throughput - loss, kept)

    def _greedy(self, gpus: Allocation) -> Share:
        left = np.array(gpus, dtype=int)
        taken: set[tuple[str, ...]] = set()
        pipelines = []
        total = 0.0
        for _ in range(MAX_PIPELINES):
            if not self.configs or not left.any():
                break
            rate = np.min(np.where(self.pool, self.per_gpu * left[self.type_of], np.inf), axis=1)
            for i, route in enumerate(self.routes):
                if route in taken:
                    rate[i] = 0.0
            best = int(np.argmax(rate))
            if rate[best] <= 0:
                break
            c = self.configs[best]
            vgpus = tuple(math.ceil(rate[best] / x - 1e-9) for x in c.vgpu_throughput)
            for d, ((_, v), n) in enumerate(zip(c.resources, vgpus)):
                left[self.type_of[best, d]] -= math.ceil(n / v)
            taken.add(self.routes[best])
            pipelines.append((c, vgpus))
            total += float(rate[best])
        return Share(gpus, total, tuple(pipelines))


def exchange_gpus(
    configs: Mapping[str, Sequence[Config]],
    weights: Mapping[str, float],
    gpus: Mapping[str, int],
    start: Mapping[str, Share],
    deadline: float,
    polish: Callable[[str, Allocation, float], Share | None] | None = None,
) -> dict[str, Share]:
    """From ``start`` (each model's GPUs, with what it serves there), move GPUs to the model with
    the lowest throughput / weight while a move lifts it and leaves every donor above its old
    level; every share is a plan within ``gpus``. Stops at ``deadline``.

    When no move helps, ``polish(model, gpus, deadline)`` (if given) may serve more on a model's
    GPUs (an exact solve where the greedy valuation falls short), the model furthest behind first:
    a donor that serves more can then spare a GPU. The search goes on until polishing every model
    finds nothing better.
    """
    types = list(gpus)
    values = {m: Valuation(cs, types) for m, cs in configs.items()}
    for m, share in start.items():
        if share.throughput >= values[m](share.gpus).throughput:
            values[m].cache[share.gpus] = share
    shares = {m: values[m](start[m].gpus) for m in configs}
    free = np.array([gpus[g] for g in types]) - np.sum([s.gpus for s in shares.values()], axis=0)
    if (free < 0).any():
        over = {g: int(-f) for g, f in zip(types, free) if f < 0}
        raise ValueError(f"the start allocation uses more GPUs than the cluster has: {over} over")
    bundles = [b for size in BUNDLE_SIZES for b in combinations_with_replacement(range(len(types)), size)]
    polished: set[tuple[str, Allocation]] = set()
    while time.perf_counter() < deadline:
        worst = min(shares, key=lambda m: shares[m].throughput / weights[m])
        move = _best_move(worst, shares, values, weights, free, bundles)
        if move is None:
            if polish is None or not _polished(shares, values, polish, polished, weights, deadline):
                break
            continue
        for m, share in move.items():
            free -= np.array(share.gpus) - np.array(shares[m].gpus)
            shares[m] = share
    return shares


def _polished(
    shares: dict[str, Share],
    values: Mapping[str, Valuation],
    polish: Callable[[str, Allocation, float], Share | None],
    done: set[tuple[str, Allocation]],
    weights: Mapping[str, float],
    deadline: float,
) -> bool:
    """Polish each model's share not polished yet, the furthest behind first; whether one improved."""
    improved = False
    for m in sorted(shares, key=lambda m: shares[m].throughput / weights[m]):
        if (m, shares[m].gpus) in done or time.perf_counter() >= deadline:
            continue
        done.add((m, shares[m].gpus))
        better = polish(m, shares[m].gpus, deadline)
        if better is not None and better.throughput > shares[m].throughput * (1 + 1e-9):
            values[m].cache[better.gpus] = shares[m] = better
            improved = True
    return improved


def _best_move(
    worst: str,
    shares: Mapping[str, Share],
    values: Mapping[str, Valuation],
    weights: Mapping[str, float],
    free: np.ndarray,
    bundles: Sequence[tuple[int, ...]],
) -> dict[str, Share] | None:
    """New shares for ``worst`` and its donors that lift ``worst`` the most (``None``: no move lifts it)."""
    level = shares[worst].throughput / weights[worst]
    best: tuple[float, dict[str, Share]] | None = None
    for bundle in bundles:
        gained = list(shares[worst].gpus)
        for k in bundle:
            gained[k] += 1
        lifted = values[worst](tuple(gained))
        if lifted.throughput / weights[worst] <= level * (1 + 1e-9) or (best is not None and lifted.throughput <= best[0]):
            continue
        move = _donors(worst, bundle, shares, values, weights, free, level)
        if move is not None:
            move[worst] = lifted
            best = (lifted.throughput, move)
    return best[1] if best is not None else None


def _donors(
    worst: str,
    bundle: tuple[int, ...],
    shares: Mapping[str, Share],
    values: Mapping[str, Valuation],
    weights: Mapping[str, float],
    free: np.ndarray,
    level: float,
) -> dict[str, Share] | None:
    """Who gives up each GPU of ``bundle``: free GPUs first, else the model that stays highest above
    ``level`` without it, if need be with free GPUs of other types in return (``None`` if none can)."""
    spare = free.copy()
    after: dict[str, Share] = {}
    for k in bundle:
        if spare[k] > 0:
            spare[k] -= 1
            continue
        found = None
        for compensations in ([()], _compensations(spare, k)):
            options = []
            for m, share in shares.items():
                current = after.get(m, share)
                if m == worst or current.gpus[k] == 0:
                    continue
                for back in compensations:
                    changed = list(current.gpus)
                    changed[k] -= 1
                    for j in back:
                        changed[j] += 1
                    less = values[m](tuple(changed)) if back else values[m].without(current, k)
                    if less.throughput / weights[m] > level * (1 + 1e-9):
                        options.append((less.throughput / weights[m], m, less, back))
            if options:
                found = max(options, key=lambda o: o[0])
                break
        if found is None:
            return None
        _, m, less, back = found
        after[m] = less
        for j in back:
            spare[j] -= 1
    return after


def _compensations(spare: np.ndarray, taken: int) -> list[tuple[int, ...]]:
    """Free GPUs a donor of a GPU of type ``taken`` may get in return: one or two of other types."""
    types = [j for j in range(len(spare)) if j != taken and spare[j] > 0]
    one: list[tuple[int, ...]] = [(j,) for j in types]
    return one + [(i, j) for i, j in combinations_with_replacement(types, 2) if i != j or spare[i] >= 2]

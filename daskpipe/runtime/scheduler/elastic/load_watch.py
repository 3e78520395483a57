"""The elastic controller's periodic look at the load (:mod:`daskpipe.runtime.scheduler.elastic.controller`): the
offered and bad rates of each model over ``load_window_s``, and what they call for: a re-plan when
a deployment's load mix shifted or its stages left their profile's band, more GPUs for a model
that misses its SLO, and the surplus slots of GPU types that idle (Symphony's rules)."""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import replace
from typing import Callable, Collection, Iterable

import numpy as np

from daskpipe.plan.schema import Plan
from daskpipe.runtime.scheduler.elastic.state import Deployment, ElasticSettings
from daskpipe.runtime.scheduler.models import Models
from daskpipe.sched.api import Dispatcher

logger = logging.getLogger(__name__)


class LoadWatch:
    """Samples the served models' counters once a tick and judges the load; ``schedule(reason)``
    asks the controller for a re-plan."""

    def __init__(self, models: Models, settings: ElasticSettings, schedule: Callable[[str], None]):
        self.models = models
        self.settings = settings
        self.schedule = schedule
        self.samples: deque[tuple[float, dict[str, tuple[int, int]]]] = deque()  # (time, model -> (submitted, bad))

    def sample(self, now: float) -> None:
        """Count each model's submitted and badly ended requests; keep the samples of the window."""
        self.samples.append(
            (
                now,
                {
                    m: (s.counts["submitted"], sum(s.dropped.values()) + s.counts["failed"] + s.counts["completed"] - s.counts["on_time"])
                    for m, s in self.models.ledgers.items()
                },
            )
        )
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.settings.load_window_s:
            self.samples.popleft()

    def rates(self) -> dict[str, tuple[float, float]]:
        """model -> (offered requests/s, share of them that ended badly) over the last samples."""
        if len(self.samples) < 2:
            return {}
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        span = max(t1 - t0, 1e-9)
        rates = {}
        for model, (submitted, bad) in last.items():
            before = first.get(model, (0, 0))
            offered = submitted - before[0]
            rates[model] = (offered / span, (bad - before[1]) / offered if offered > 0 else 0.0)
        return rates

    def carries_load(self, dep: Deployment, plan: Plan) -> bool:
        """Whether ``plan`` serves every model's observed rate at the target utilisation."""
        rates = self.rates()
        return all(
            plan.model(m).throughput / dep.serving.time_dilation * self.settings.target_utilisation >= rates.get(m, (0.0, 0.0))[0]
            for m in dep.models
        )

    def check_load_mix(self, deployments: Iterable[Deployment], now: float) -> None:
        """Re-plan a deployment of several models whose load shares moved, weighted by the observed rates."""
        rates = self.rates()
        for dep in deployments:
            if len(dep.models) < 2 or now - dep.replanned_at < self.settings.load_interval_s:
                continue
            offered = {m: rates.get(m, (0.0, 0.0))[0] for m in dep.models}
            total_offered, total_weight = sum(offered.values()), sum(dep.weights.values())
            if total_offered <= 0:
                continue
            shifted = max(
                abs(offered[m] / total_offered - dep.weights[m] / total_weight) / (dep.weights[m] / total_weight) for m in dep.models
            )
            if shifted > self.settings.load_shift:
                dep.weights = {m: max(offered[m] / total_offered, 1e-3) for m in dep.models}
                dep.replanned_at = now
                self.schedule(f"load mix shifted by {shifted:.0%}")

    def check_profiles(self, deployments: Iterable[Deployment], now: float) -> None:
        """Re-plan a deployment whose stages run outside the profile's band, on its profiles
        scaled to what the stages measure (the plan is only as good as its latency tables)."""
        band = self.settings.profile_band
        for dep in deployments:
            if now - dep.replanned_at < self.settings.load_interval_s:
                continue
            drifted = []
            for model, spec in dep.models.items():
                ledger = self.models.ledgers.get(model)
                if ledger is None or ledger.closing:
                    continue
                factors: dict[tuple[str, int], np.ndarray] = {}
                for (p, q), ratio in sorted(ledger.dispatcher.measured_ratios().items()):
                    if 1 / band <= ratio <= band:
                        continue
                    part = ledger.model.pipelines[p].partitions[q]
                    factors.setdefault((part.gpu, part.slices), np.ones(spec.profile.num_blocks))[part.blocks[0] : part.blocks[1]] = ratio
                    drifted.append(f"{model} blocks [{part.blocks[0]}, {part.blocks[1]}) on {part.gpu} run at {ratio:.2f}x their profile")
                if factors:
                    tables = dict(spec.profile.latency_us)
                    for kind, scale in factors.items():
                        tables[kind] = tables[kind] * scale[:, None]
                    spec.profile = replace(spec.profile, latency_us=tables)
            if drifted:
                dep.replanned_at = now
                logger.warning("daskpipe: %s; re-planning on the measured latencies", "; ".join(drifted))
                self.schedule("; ".join(drifted))

    def wanted_gpus(self, pools: Collection[Dispatcher] = ()) -> dict[str, int]:
        """GPU type -> more slots, for each model whose bad rate r on N slots is over
        ``scale_up_bad_rate``: N·r/(1-r) more of the type most of its stages run on. The models of
        one of the shared ``pools`` (their dispatchers) count as one: the pool's bad rate on its slots."""
        rates = self.rates()
        groups: dict[int, list[str]] = {}  # a model alone, or a pool's models together
        for model, ledger in self.models.ledgers.items():
            shared = any(ledger.dispatcher is pool for pool in pools)
            groups.setdefault(id(ledger.dispatcher) if shared else id(ledger), []).append(model)
        wanted: Counter[str] = Counter()
        for models in groups.values():
            measured = [rates.get(m, (0.0, 0.0)) for m in models]
            offered = sum(rate for rate, _ in measured)
            bad = sum(rate * share for rate, share in measured) / offered if offered > 0 else 0.0
            addresses = [a for m in models for _, _, a in self.models.ledgers[m].stages if a in self.models.slots]
            if bad > self.settings.scale_up_bad_rate and addresses:
                slots = len(addresses) if len(models) == 1 else len(set(addresses))  # a model's stages; a pool's slots
                gpu = Counter(self.models.slots[a].gpu for a in addresses).most_common(1)[0][0]
                wanted[gpu] += math.ceil(slots * min(bad, 0.9) / (1 - min(bad, 0.9)))
        return dict(wanted)

    def surplus(self, now: float, serving: set[str]) -> set[str]:
        """The ``serving`` addresses a GPU type could do without at the target utilisation, by
        their busy share over the window (none before the window has two samples)."""
        if len(self.samples) < 2:
            return set()
        window = self.samples[-1][0] - self.samples[0][0]
        busy = self.models.metrics.busy_seconds(now - window, now)
        by_type: dict[str, list[str]] = {}
        for address in sorted(serving):
            slot = self.models.slots.get(address)
            if slot is not None:
                by_type.setdefault(slot.gpu, []).append(address)
        surplus: set[str] = set()
        for addresses in by_type.values():
            utilisation = sum(busy.get(a, 0.0) for a in addresses) / (window * len(addresses))
            extra = len(addresses) - max(1, math.ceil(len(addresses) * utilisation / self.settings.target_utilisation))
            if extra > 0:
                surplus.update(addresses[-extra:])
        return surplus

"""Usher (OSDI'24) with the thesis's weighted SM utilisation (WSM) as its compute requirement, and
the thesis's WSM-MILP, which replaces Usher's greedy ordering by one python-mip model.

``Creq`` is WSM in percent, ``Mreq`` the memory in percent of the GPU. With a kernel trace,
``weighted_sm_utilisation`` computes WSM as the thesis does (SMs each kernel's blocks need, from
its launch configuration, weighted by kernel duration); without one (emulation), WSM is the share
beyond which the model's running time improves by less than ``saturation`` (10%): the SMs it can
keep busy. Both policies plan with isolated (whole-GPU) latencies, as the thesis's policies do, and
the router waits at most MAX_WAIT = 100 ms for a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from daskpipe.colocation.latency import Colocated, InterferenceModel
from daskpipe.colocation.policy import Gpu, PlacementPlan, PlacementPolicy, Replica, Strategy, Workload
from daskpipe.mipmodels import mip_model

BATCHES = (1, 2, 4, 8, 16, 32)
MAX_WAIT_MS = 100.0


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel of an nsys ``cuda_gpu_trace``: duration and launch configuration."""

    duration_us: float
    blocks: int  # grid_x·grid_y·grid_z
    threads_per_block: int
    registers_per_thread: int
    shared_mem_bytes: int


@dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of the CUDA technical-specifications table (defaults: V100 / Turing-class)."""

    sm_count: int
    max_threads: int = 2048
    max_registers: int = 65536
    max_shared_mem: int = 98304
    max_blocks: int = 32


def weighted_sm_utilisation(kernels: Sequence[KernelLaunch], limits: SmLimits) -> float:
    """WSM (thesis §5.3.2): per kernel, blocks per SM = min of the thread, shared-memory, register
    and block bounds; SMs needed = ceil(blocks / that), as % of the GPU (capped at 100); averaged
    weighted by kernel duration."""
    total = sum(k.duration_us for k in kernels)
    if total <= 0:
        raise ValueError("weighted_sm_utilisation needs kernels with positive total duration")
    weighted = 0.0
    for k in kernels:
        bounds = [limits.max_threads // k.threads_per_block, limits.max_blocks]
        if k.shared_mem_bytes:
            bounds.append(limits.max_shared_mem // k.shared_mem_bytes)
        if k.registers_per_thread:
            bounds.append(limits.max_registers // (k.threads_per_block * k.registers_per_thread))
        per_sm = max(1, min(bounds))
        weighted += k.duration_us * min(100.0, 100.0 * math.ceil(k.blocks / per_sm) / limits.sm_count)
    return weighted / total


def emulated_wsm(model: InterferenceModel, name: str, gpu_type: str, batch: int, saturation: float = 0.10) -> float:
    """WSM (%) from the latency model: the smallest 1% step of SMs whose running time is within
    ``saturation`` of the whole GPU's."""
    c = model.coeff(name, gpu_type)
    sms = model.gpu(gpu_type).sm_count
    full = c.solo_running_ms(batch, sms)
    for pct in range(1, 101):
        if c.solo_running_ms(batch, sms * pct / 100) <= full * (1 + saturation):
            return float(pct)
    return 100.0


@dataclass(frozen=True)
class Option:
    """A (model, batch) candidate on one GPU type: isolated goodput and requirements in %."""

    batch: int
    goodput: float
    creq: float
    mreq: float


class _UsherBase(PlacementPolicy):
    def __init__(self, model: InterferenceModel, *, saturation: float = 0.10) -> None:
        super().__init__(model)
        self.saturation = saturation

    def options(self, w: Workload, gpu_type: str) -> list[Option]:
        """Batches whose isolated latency meets the SLO."""
        out = []
        for b in (b for b in BATCHES if b <= self.model.max_batch):
            latency = self.model.exec_ms(gpu_type, Colocated(w.name, 1.0, b))
            if latency <= w.slo_ms:
                mem = 100.0 * self.model.memory_mb(w.name, gpu_type, b) / self.model.gpu(gpu_type).memory_mb
                out.append(Option(b, 1000.0 * b / latency, emulated_wsm(self.model, w.name, gpu_type, b, self.saturation), mem))
        return out

    def replica(self, w: Workload, uid: str, option: Option) -> Replica:
        return Replica(w.name, uid, min(1.0, option.creq / 100.0), option.batch, timeout_ms=MAX_WAIT_MS)


class UsherPolicy(_UsherBase):
    """Usher: per-model configuration, grouping by |ΣCreq − ΣMreq|, greedy best-fit placement."""

    strategy = Strategy.USHER
    GROUP_SIZE = 4

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        self.check(workloads, gpus)
        gpu_type = gpus[0].type  # Usher assumes one GPU type
        configs: dict[str, tuple[int, Option]] = {}
        for w in workloads:
            opts = self.options(w, gpu_type)
            if not opts:
                continue
            reps = math.ceil(w.rate / opts[-1].goodput) if w.rate > 0 else 1  # c_m^l at the largest batch
            if reps > len(gpus):
                continue  # Usher does not serve it
            configs[w.name] = (reps, next(o for o in opts if reps * o.goodput >= w.rate))
        groups = self._groups(configs)
        load = {g.uid: [0.0, 0.0] for g in gpus}  # ΣCreq, ΣMreq
        used_by_group: dict[int, set[str]] = {}
        replicas: list[Replica] = []
        by_name = {w.name: w for w in workloads}
        for gi, group in enumerate(groups):
            for name in self._order(group, configs):
                reps, option = configs[name]
                for _ in range(reps):
                    uid = self._pick(load, used_by_group.setdefault(gi, set()), option, {r.gpu for r in replicas if r.model == name})
                    if uid is None:
                        break
                    load[uid][0] += option.creq
                    load[uid][1] += option.mreq
                    used_by_group[gi].add(uid)
                    replicas.append(self.replica(by_name[name], uid, option))
        unserved = sorted(set(by_name) - {r.model for r in replicas})
        return PlacementPlan(self.strategy.value, tuple(replicas), {"groups": groups, "unserved": unserved})

    def _groups(self, configs: dict[str, tuple[int, Option]]) -> list[list[str]]:
        """Merge the pair with the smallest |ΣCreq − ΣMreq| until no merge stays within GROUP_SIZE
        (a greedy stand-in for the thesis's rounds of minimum-weight matching)."""
        groups = [[m] for m in sorted(configs)]

        def imbalance(group: list[str]) -> float:
            return abs(sum(configs[m][1].creq - configs[m][1].mreq for m in group))

        while True:
            pairs = [
                (imbalance(a + b), i, j)
                for i, a in enumerate(groups)
                for j, b in enumerate(groups)
                if i < j and len(a) + len(b) <= self.GROUP_SIZE
            ]
            if not pairs:
                return groups
            _, i, j = min(pairs)
            groups[i] = groups[i] + groups.pop(j)

    @staticmethod
    def _order(group: list[str], configs: dict[str, tuple[int, Option]]) -> list[str]:
        """Memory-heavy and compute-heavy alternate (each by Creq + Mreq, descending), neutral last."""

        def rreq(m: str) -> float:
            return -(configs[m][1].creq + configs[m][1].mreq)

        memory = sorted((m for m in group if configs[m][1].mreq >= 1.2 * configs[m][1].creq), key=rreq)
        compute = sorted((m for m in group if configs[m][1].creq >= 1.2 * configs[m][1].mreq), key=rreq)
        neutral = sorted((m for m in group if m not in memory and m not in compute), key=rreq)
        alternated = [m for pair in zip(memory, compute) for m in pair]
        longer = memory if len(memory) > len(compute) else compute
        return alternated + longer[min(len(memory), len(compute)) :] + neutral

    @staticmethod
    def _pick(load: dict[str, list[float]], group_gpus: set[str], option: Option, taken: set[str]) -> str | None:
        """Best fit among GPUs of the group, then busy GPUs, then empty ones."""
        fits = [u for u, (c, m) in load.items() if u not in taken and c + option.creq <= 100 and m + option.mreq <= 100]
        for tier in ([u for u in fits if u in group_gpus], [u for u in fits if load[u][0] > 0], fits):
            if tier:
                return min(tier, key=lambda u: 200 - load[u][0] - load[u][1])
        return None


class WsmMilpPolicy(_UsherBase):
    """The thesis's WSM-MILP: one MILP over (model, batch, GPU); maximise served goodput, with a
    small penalty on batch size to break the ties the thesis saw go to large batches."""

    strategy = Strategy.WSM_MILP

    def __init__(
        self, model: InterferenceModel, *, saturation: float = 0.10, time_limit_s: float = 10.0, batch_penalty: float = 1e-3
    ) -> None:
        super().__init__(model, saturation=saturation)
        self.time_limit_s, self.batch_penalty = time_limit_s, batch_penalty

    def place(self, workloads: Sequence[Workload], gpus: Sequence[Gpu]) -> PlacementPlan:
        import mip

        self.check(workloads, gpus)
        options = {(w.name, t): self.options(w, t) for w in workloads for t in {g.type for g in gpus}}
        batches = sorted({o.batch for opts in options.values() for o in opts})
        milp = mip_model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
        milp.verbose = 0
        x = {}
        for w in workloads:
            for g in gpus:
                for o in options[(w.name, g.type)]:
                    x[w.name, o.batch, g.uid] = (milp.add_var(var_type=mip.BINARY), o)
        y = {(w.name, b): milp.add_var(var_type=mip.BINARY) for w in workloads for b in batches}
        served = {w.name: milp.add_var(lb=0.0, ub=w.rate) for w in workloads}
        for w in workloads:
            milp += served[w.name] <= mip.xsum(o.goodput * v for (m, _, _), (v, o) in x.items() if m == w.name)
            milp += mip.xsum(y[w.name, b] for b in batches) <= 1
            for g in gpus:
                milp += mip.xsum(v for (m, _, u), (v, _) in x.items() if m == w.name and u == g.uid) <= 1
        for (m, b, _), (v, _) in x.items():
            milp += v <= y[m, b]
        for g in gpus:
            milp += mip.xsum(o.creq * v for (_, _, u), (v, o) in x.items() if u == g.uid) <= 100
            milp += mip.xsum(o.mreq * v for (_, _, u), (v, o) in x.items() if u == g.uid) <= 100
        milp.objective = mip.xsum(served.values()) - self.batch_penalty * mip.xsum(b * v for (_, b, _), (v, _) in x.items())
        status = milp.optimize(max_seconds=self.time_limit_s)
        by_name = {w.name: w for w in workloads}
        replicas = tuple(
            self.replica(by_name[m], u, o) for (m, _, u), (v, o) in sorted(x.items(), key=lambda kv: kv[0]) if v.x is not None and v.x > 0.5
        )
        return PlacementPlan(
            self.strategy.value,
            replicas,
            {"solver": "cbc", "status": status.name, "objective": round(float(milp.objective_value or 0.0), 2)},
        )

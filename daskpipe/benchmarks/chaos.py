"""``daskpipe bench chaos``: a worker fails mid-batch, then two GPUs of a new type join, under load.

A small CNN (random weights; nothing is downloaded) is profiled for emulated L4, T4 and A10 GPUs
with the analytic estimator. It is served on an :class:`EmulatedCluster` of worker processes (so a
worker can really be killed) holding three L4 and two T4 slots, by a PPipe-style two-stage plan:
blocks [0, 2) on a pool of two L4, the rest on a pool of two T4 (the bottleneck), batch 8, an SLO
of ``SLO_FACTOR`` x the pipeline's latency; the third L4 is spare.
Time dilation k brings the plan's capacity down to ``capacity`` requests per second, which the
two cores of a small machine carry. An open-loop Poisson stream at ``load`` x capacity runs
through three phases:

1. ``phase_s`` seconds of steady serving (``attainment_before``);
2. an L4 worker of the first pool fails while it holds a batch, as ``fault`` says, and serving goes
   on for ``phase_s`` seconds (``attainment_during`` is the 10 s after the fault starts, or the
   whole phase when it is shorter, as in the tests):

   * ``kill``: SIGKILL. Its batches are re-dispatched, its slot leaves the pools, the plugin
     re-plans with the MILP for what is left (the spare L4 included; its Nanny also restarts the
     process, which joins again).
   * ``stop``: SIGSTOP for ``STOP_S`` seconds, then SIGCONT: a frozen worker that Dask does not
     notice. The plugin suspects its slot once a batch is overdue, re-dispatches its batches,
     and re-admits it when a probe computes in line again (:mod:`daskpipe.runtime.scheduler.gray`).
   * ``slow``: its emulated GPU holds every batch ``SLOW_FACTOR`` x its profiled latency for
     ``SLOW_S`` seconds (a throttled GPU);
   * ``flap``: SIGKILL a busy worker of any pool, another :data:`FLAP_S` seconds later, and two at
     once :data:`FLAP_S` seconds after that (Nannies restart each, and the plugin re-plans as they
     leave and join): last stages die holding outputs their clients may not have read yet;
3. two emulated A10 GPUs join on a new node; once the plugin has re-planned and migrated to a plan
   that uses them (``scale_up_seconds`` after they were asked for, worker start included), serving
   goes on for ``phase_s`` seconds (``attainment_after`` is everything after the first 10 s past
   the kill, ``attainment_after_scale_up`` the last phase).

A request counts as ``completed`` when its output is in the client's hands (a last stage sends
it with the completion to a client with a stream to it, whatever its size; else it is fetched when
the future finishes); at the end every future is read again, and one that ended otherwise since
(Dask cancelled its key when its worker died) counts as ``lost`` as ``cancelled after it
finished``. Every future is counted by how it ended: ``completed``, ``dropped`` by reason,
``failed`` by cause, and ``lost`` (= submitted minus all of these; the contract is 0). ``recovery_seconds`` is
how long after the fault until every following 5-second window of submissions meets the SLO for
at least 99% of its requests; ``late_beyond_2x_slo`` counts results that came later than twice the
SLO (the plugin drops a request instead, :mod:`daskpipe.runtime.scheduler.gray`), and
``attainment_3s_after_fault`` the attainment of the requests submitted from 3 s after the fault
to the end of its phase. ``plan_before`` and
``plan_after`` summarise the plans in force.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterator

import click
import numpy as np

from daskpipe.profiles.small_model import estimated_profile, small_cnn
from daskpipe.runtime.worker.stage import slow_down

MODEL = "chaos-cnn"
GPU_TYPES = ("L4", "T4", "A10")
CLUSTER = {"L4": 3, "T4": 2}
NEW_GPUS = {"A10": 2}
INPUT_SHAPE = (3, 32, 32)
BATCH = 8
DISTINCT_FRAMES = 16
WINDOW_S = 5.0  # attainment windows for recovery
RECOVERY_TARGET = 0.99
DURING_S = 10.0  # the window of attainment_during after the fault
RECOVERY_BUDGET_S = 3.0  # attainment_3s_after_fault: every request submitted this long after the fault, to the end of its phase
SCALE_UP_TIMEOUT_S = 180.0
COMPUTE_HEADROOM = 4.0  # emulated latency >= this x the CPU's real compute of the stage
BW_GBPS = 100.0  # the emulated nodes' NICs
SLO_FACTOR = 3.0  # the SLO, in latencies of the two-pool pipeline at BATCH
FAULTS = ("kill", "stop", "slow", "flap")
FLAP_S = 3.0  # between the kills of the flapping fault
STOP_S = 10.0  # a SIGSTOPped worker's freeze
SLOW_S = 20.0  # a slowed emulated GPU's throttling ...
SLOW_FACTOR = 3.0  # ... and how much slower it holds batches


def two_pool_plan(profile, first: tuple[str, int], second: tuple[str, int], cut: int, bw_gbps: float = BW_GBPS):
    """The profile with an SLO of ``SLO_FACTOR`` x the pipeline's latency, and its plan: one
    pipeline at batch ``BATCH``, blocks [0, cut) on ``first`` = (GPU type, slots), the rest on
    ``second``; the partitions' latencies, transfer and throughput are read off ``profile``."""
    from daskpipe.plan.schema import ModelPlan, Partition, Pipeline, Plan

    transfer_us = profile.cut_bytes(cut) * BATCH * 8 / (bw_gbps * 1e9) * 1e6
    parts = (
        Partition(
            blocks=(0, cut),
            gpu=first[0],
            slices=1,
            vgpus=first[1],
            latency_us=profile.latency(first[0], 1, BATCH, 0, cut),
            transfer_us=transfer_us,
        ),
        Partition(
            blocks=(cut, profile.num_blocks), gpu=second[0], slices=1, vgpus=second[1], latency_us=profile.latency(second[0], 1, BATCH, cut)
        ),
    )
    throughput = min(part.vgpus * BATCH / (part.latency_us * 1e-6) for part in parts)
    pipeline = Pipeline(batch_size=BATCH, throughput=throughput, partitions=parts)
    slo_us = SLO_FACTOR * pipeline.latency_us
    model = ModelPlan(name=profile.model, slo_us=slo_us, weight=1.0, throughput=throughput, pipelines=(pipeline,))
    return replace(profile, slo_us=slo_us), Plan(objective=throughput, models=(model,), cluster={"bw_gbps": bw_gbps})


def time_dilation(model, example, profile, capacity_per_s: float, plan) -> float:
    """k such that every GPU type's emulated latency of every block range at ``BATCH`` is at least
    ``COMPUTE_HEADROOM`` x this CPU's real compute of it, and the plan serves ``capacity_per_s``."""
    import torch

    from daskpipe.profiles.fx import cut_model
    from daskpipe.profiles.profiler import time_module

    blocked = cut_model(model, example, profile.meta["segment_boundaries"])
    whole = torch.nn.Sequential(*blocked.blocks)
    cpu_us = time_module(whole, torch.randn(BATCH, *blocked.input_shape), repeats=5)
    fastest_us = min(profile.latency(gpu, 1, BATCH) for gpu, _ in profile.latency_us)
    for_compute = COMPUTE_HEADROOM * cpu_us / fastest_us
    return float(np.ceil(max(for_compute, plan.model(profile.model).throughput / capacity_per_s)))


def _uses(plan, gpus) -> bool:
    return any(q.gpu in gpus for p in plan.model(MODEL).pipelines for q in p.partitions)


def summarise(plan) -> list[dict[str, Any]]:
    """A plan's pipelines as batch size and (blocks, GPU type, slots) per partition."""
    return [
        {"batch_size": p.batch_size, "partitions": [{"blocks": list(q.blocks), "gpu": q.gpu, "vgpus": q.vgpus} for q in p.partitions]}
        for p in plan.model(MODEL).pipelines
    ]


def recovery_seconds(submitted_at: np.ndarray, good: np.ndarray, kill_at: float, end_at: float) -> float:
    """Seconds from ``kill_at`` until every ``WINDOW_S`` window of submissions that starts later
    (in 0.5 s steps, up to ``end_at``) has at least ``RECOVERY_TARGET`` of its requests good."""
    starts = np.arange(kill_at, max(kill_at, end_at - WINDOW_S) + 1e-9, 0.5)
    bad_windows = []
    for start in starts:
        inside = (submitted_at >= start) & (submitted_at < start + WINDOW_S)
        if inside.any() and good[inside].mean() < RECOVERY_TARGET:
            bad_windows.append(start)
    return float(bad_windows[-1] + WINDOW_S - kill_at) if bad_windows else 0.0


class _Ledger:
    """How each submitted request ended, noted as each future finishes (a result is not fetched:
    its key in memory is the completion; an error is fetched to read its reason)."""

    def __init__(self, slo_s: float):
        self.slo_s = slo_s
        self.submitted: list[float] = []
        self.outcome: dict[int, tuple[str, str, float]] = {}  # index -> (kind, reason/cause, end time)
        self.lock = threading.Lock()

    def record(self, index: int, future: Any) -> None:
        from daskpipe.runtime.errors import RequestDropped, RequestFailed

        end = time.monotonic()
        if not future.done():
            kind, detail = "lost", "never ended"
        elif future.status == "finished":
            try:
                future.result()  # in hand already when it came with the completion, else fetched now
                kind, detail = "completed", ""
            except BaseException as exc:  # noqa: BLE001 - lost before it reached the client
                kind, detail = "lost", type(exc).__name__
        else:
            try:
                exc = future.exception()
            except BaseException as cancelled:  # noqa: BLE001 - a cancelled future has no exception to give
                exc = cancelled
            if isinstance(exc, RequestDropped):
                kind, detail = "dropped", exc.reason
            elif isinstance(exc, RequestFailed):
                kind, detail = "failed", type(exc.cause).__name__ if exc.cause is not None else "RequestFailed"
            else:  # anything else is a request daskpipe lost
                kind, detail = "lost", type(exc).__name__
        with self.lock:
            self.outcome[index] = (kind, detail, end)

    def good(self) -> np.ndarray:
        flags = np.zeros(len(self.submitted), dtype=bool)
        for i, (kind, _, end) in self.outcome.items():
            flags[i] = kind == "completed" and end - self.submitted[i] <= self.slo_s
        return flags

    def late_beyond(self, slos: float) -> int:
        """Results that came more than ``slos`` SLOs after their request was submitted."""
        return sum(kind == "completed" and end - self.submitted[i] > slos * self.slo_s for i, (kind, _, end) in self.outcome.items())


def run_chaos(
    *,
    seed: int = 0,
    capacity: float = 40.0,
    load: float = 0.8,
    phase_s: float = 20.0,
    fault: str = "kill",
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """The figures of ``daskpipe bench chaos`` (see the module docstring)."""
    import torch
    from distributed import Client, wait

    from daskpipe.runtime.adaptive import add_emulated_gpus
    from daskpipe.runtime.client.service import deploy
    from daskpipe.runtime.cluster import EmulatedCluster
    from daskpipe.runtime.scheduler.plugin import plugin_of

    if not 0 < load <= 1:
        raise ValueError(f"load must be in (0, 1], got {load!r}")
    if not capacity > 0 or not phase_s > RECOVERY_BUDGET_S:
        raise ValueError(f"capacity must be > 0 and phase_s > {RECOVERY_BUDGET_S}, got {capacity!r} and {phase_s!r}")
    during_s = min(DURING_S, phase_s)
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    model = small_cnn()
    frames = torch.randn(DISTINCT_FRAMES, 1, *INPUT_SHAPE, generator=torch.Generator().manual_seed(seed))
    profile, plan = two_pool_plan(estimated_profile(model, frames[0], GPU_TYPES, MODEL, BATCH), ("L4", 2), ("T4", 2), cut=2)
    k = time_dilation(model, frames[0], profile, capacity, plan)
    rate = load * plan.model(MODEL).throughput / k
    slo_s = profile.slo_us * 1e-6 * k
    ledger = _Ledger(slo_s)
    with EmulatedCluster(CLUSTER, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        service = deploy(client, {MODEL: model}, example_inputs={MODEL: frames[0]}, plan=plan, profiles={MODEL: profile}, time_dilation=k)
        plugin = plugin_of(cluster.scheduler)
        with service:
            wait(service.map(MODEL, [frames[i % DISTINCT_FRAMES] for i in range(3 * BATCH)]), timeout=60)  # warm every stage
            plan_before = service.plan
            futures: list[Any] = []
            stop = threading.Event()

            def submit_forever() -> None:
                due = time.monotonic()
                while not stop.is_set():
                    due += rng.exponential(1 / rate)
                    time.sleep(max(0.0, due - time.monotonic()))
                    index = len(ledger.submitted)
                    ledger.submitted.append(time.monotonic())
                    future = service.submit(MODEL, frames[index % DISTINCT_FRAMES])
                    future.add_done_callback(lambda f, i=index: ledger.record(i, f))
                    futures.append(future)

            started = time.monotonic()
            submitter = threading.Thread(target=submit_forever, name="chaos-submitter", daemon=True)
            submitter.start()
            time.sleep(phase_s)
            advance(note="steady phase")
            victim = _busy_worker(plugin, plugin.models.slots if fault == "flap" else plan.model(MODEL).pipelines[0].partitions[0].gpu)
            with _fault(client, victim, fault, plugin):
                kill_at = time.monotonic()
                time.sleep(phase_s)
            advance(note=f"after the fault ({fault})")
            add_emulated_gpus(cluster, NEW_GPUS)
            added_at = time.monotonic()
            deadline = added_at + SCALE_UP_TIMEOUT_S  # worker processes start slowly on a loaded machine
            while not _uses(service.plan, NEW_GPUS) and time.monotonic() < deadline:
                time.sleep(0.25)
            scale_at = time.monotonic()
            time.sleep(phase_s)
            stop.set()
            submitter.join()
            end_at = time.monotonic()
            advance(note="after the scale-up")
            try:
                wait(futures, timeout=max(60.0, 10 * slo_s))
            except TimeoutError:
                pass  # those still pending are counted as lost
            for index, future in enumerate(futures):
                if index not in ledger.outcome:  # its done-callback has not run yet
                    ledger.record(index, future)
                elif ledger.outcome[index][0] == "completed" and future.status != "finished":
                    ledger.outcome[index] = ("lost", "cancelled after it finished", ledger.outcome[index][2])
            plan_after = service.plan
            replans = [{"reasons": h["reasons"], "seconds": round(h["seconds"], 3)} for h in plugin.elastic.history]
            retried = service.status()[MODEL].get("retried", 0)
    submitted_at = np.array(ledger.submitted)
    good = ledger.good()
    kinds = Counter(kind for kind, _, _ in ledger.outcome.values())
    dropped = Counter(detail for kind, detail, _ in ledger.outcome.values() if kind == "dropped")
    failed = Counter(detail for kind, detail, _ in ledger.outcome.values() if kind == "failed")

    def attainment(lo: float, hi: float) -> float | None:
        inside = (submitted_at >= lo) & (submitted_at < hi)
        return float(good[inside].mean()) if inside.any() else None

    return {
        "seed": seed,
        "fault": fault,
        "model": MODEL,
        "cluster": dict(CLUSTER),
        "added": dict(NEW_GPUS),
        "time_dilation": k,
        "slo_ms": slo_s * 1e3,
        "rate_per_s": rate,
        "load": load,
        "victim": victim[1],
        "retried": retried,
        "submitted": len(ledger.submitted),
        "completed": kinds["completed"],
        "dropped": dict(dropped),
        "failed": dict(failed),
        "lost": len(ledger.submitted) - kinds["completed"] - sum(dropped.values()) - sum(failed.values()),
        "late_beyond_2x_slo": ledger.late_beyond(2.0),
        "lost_as": dict(Counter(detail for kind, detail, _ in ledger.outcome.values() if kind == "lost")),
        "recovery_seconds": recovery_seconds(submitted_at, good, kill_at, added_at),
        "attainment_before": attainment(started, kill_at),
        "attainment_during": attainment(kill_at, kill_at + during_s),
        "attainment_3s_after_fault": attainment(kill_at + RECOVERY_BUDGET_S, kill_at + phase_s),
        "attainment_after": attainment(kill_at + during_s, end_at),
        "attainment_after_scale_up": attainment(scale_at, end_at),
        "plan_before": summarise(plan_before),
        "plan_after": summarise(plan_after),
        "plan_after_uses_new_gpus": _uses(plan_after, NEW_GPUS),
        "scale_up_seconds": scale_at - added_at,
        "replans": replans,
        "events_s": {
            "fault": kill_at - started,
            "gpus_asked": added_at - started,
            "gpus_in_plan": scale_at - started,
            "end": end_at - started,
        },
        "attainment_by_second": [[t, attainment(started + t, started + t + 1.0)] for t in range(int(end_at - started))],
    }


def _busy_worker(plugin: Any, among: str | Any, timeout_s: float = 30.0, spare: frozenset[str] = frozenset()) -> tuple[str, str]:
    """(address, name) of a worker while a batch runs through it: of the first pool, when
    ``among`` names its GPU type, else of any stage among the addresses ``among`` holds, but ``spare``."""
    ledger = plugin.models.ledgers[MODEL]
    if isinstance(among, str):
        pool = sorted({a for (_, q, a) in ledger.stages if q == 0 and plugin.models.slots[a].gpu == among})
    else:
        pool = sorted({a for (_, _, a) in ledger.stages if a in among and a not in spare})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [a for flight in list(ledger.flights.values()) for a in flight.addresses if a in pool]
        if busy:
            break
        time.sleep(0.001)
    victim = busy[0] if busy else pool[0]
    return victim, str(plugin.scheduler.workers[victim].name)


def _kill(client: Any, address: str) -> None:
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)


@contextlib.contextmanager
def _fault(client: Any, victim: tuple[str, str], fault: str, plugin: Any) -> Iterator[None]:
    """Inflict ``fault`` on the ``victim`` worker's process now; a stopped one is continued after
    ``STOP_S`` (and on the way out, whatever happens)."""
    address, _ = victim
    if fault in ("kill", "flap"):
        _kill(client, address)
        if fault == "flap":
            time.sleep(FLAP_S)
            second, _ = _busy_worker(plugin, plugin.models.slots)
            _kill(client, second)
            time.sleep(FLAP_S)
            pair = [_busy_worker(plugin, plugin.models.slots)[0]]
            pair.append(_busy_worker(plugin, plugin.models.slots, spare=frozenset(pair))[0])
            for each in pair:
                _kill(client, each)
        yield
        return
    pid = client.run(os.getpid, workers=[address])[address]
    if fault == "stop":
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(STOP_S, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            yield
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
    else:
        client.run(slow_down, SLOW_FACTOR, SLOW_S, workers=[address])
        yield


@click.command("chaos")
@click.option("--seed", default=0, show_default=True, help="Seeds the arrivals and the frames.")
@click.option("--capacity", default=40.0, show_default=True, help="The initial plan's capacity in requests/s after time dilation.")
@click.option("--load", default=0.8, show_default=True, help="Offered load as a fraction of that capacity.")
@click.option(
    "--phase-seconds",
    "phase_s",
    default=20.0,
    show_default=True,
    help="Seconds of each phase: steady, after the fault, after the scale-up.",
)
@click.option(
    "--fault",
    type=click.Choice(FAULTS),
    default="kill",
    show_default=True,
    help=f"kill: SIGKILL a worker; stop: SIGSTOP it for {STOP_S:g} s; slow: its emulated GPU {SLOW_FACTOR:g}x slower for {SLOW_S:g} s; "
    f"flap: SIGKILL a worker, another {FLAP_S:g} s later, then two at once.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Also write the figures to this file.")
def bench_chaos(seed: int, capacity: float, load: float, phase_s: float, fault: str, json_path: str | None) -> None:
    """Fail a stage worker mid-batch (kill, stop or slow it), then add two GPUs of a new type, under load: nothing may be lost."""
    from daskpipe.progress import progress_bar

    if not 0 < load <= 1:
        raise click.BadParameter("must be in (0, 1]", param_hint="--load")
    if not capacity > 0:
        raise click.BadParameter("must be > 0", param_hint="--capacity")
    if not phase_s > DURING_S:
        raise click.BadParameter(f"must be > {DURING_S:g}", param_hint="--phase-seconds")
    with progress_bar("chaos phases", total=3) as advance:
        figures = run_chaos(seed=seed, capacity=capacity, load=load, phase_s=phase_s, fault=fault, advance=advance)
    text = json.dumps(figures, indent=1)
    click.echo(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")

"""What comes into the scheduler plugin: models to serve, and clients' submissions.

The checks are functions of what they are given, none of the plugin's state: a model whose SLO
cannot be served, an unknown dispatcher or a malformed submit message is refused here with a clear
error, before the plugin keeps anything of it. :class:`Intake` takes the submissions that pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Sequence

from daskpipe.colocation.execute import colocated_latency, colocated_profile
from daskpipe.config import ConfigError
from daskpipe.plan.schema import ModelPlan, Plan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.scheduler.control import MAX_SHARE, ControlPath
from daskpipe.runtime.scheduler.gray import GrayPolicy
from daskpipe.runtime.scheduler.keys import Refusal, make_keys, refuse
from daskpipe.runtime.scheduler.ledger import Endings, Ledger, queue_bound
from daskpipe.runtime.scheduler.links import Links
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.wire.inputs import HeldInput, held_count
from daskpipe.runtime.wire.messages import MalformedSubmission, ServeSettings, WorkerSlot, read_submission
from daskpipe.sched.api import Dispatcher, Placement, Request, Slot
from daskpipe.sched.durations import BatchDurations
from daskpipe.sched.registry import TIMEOUT_S, add_shared_model, check_name, known, make_dispatcher, make_shared_dispatcher
from daskpipe.sched.symphony import DeferredDispatcher

logger = logging.getLogger(__name__)

SUBMIT_SLICE = 64
"""Requests of one submit message handled between two event-loop turns (a few milliseconds at
most): a message of any size never holds the loop (timers, other clients, workers' streams) for
more than one slice."""
REFUSAL_SLICE = 4096
"""Keys of a submission refused whole (malformed, or for a model nobody serves) answered between
two event-loop turns: about a millisecond, where each slice of :data:`SUBMIT_SLICE` cost a loop
turn and a write of its own (100k keys: 1563 of them)."""

LOOP_TURN_S = 0.005
"""How long a run of released keys may hold the scheduler's loop before it lets the loop turn."""

SEND_WINDOW_S = 30.0
"""How long a client's fastest way in is remembered (between one and two windows): long enough
to hold a quiet moment, short enough to follow its clock drifting from the scheduler's."""
CLOCK_STEP_S = 1.0
"""A submission this much slower than its client's fastest is taken for the client's clock
stepping back, not for a request that waited: the client's fastest trip is learnt afresh."""


class SendClocks:
    """How long each client's submissions waited on their way to the scheduler.

    A client stamps each submit message with its wall clock when the caller hands the requests
    over. The stamp's age when the scheduler reads it is the trip (the client's loop, the
    network, the scheduler's loop being busy) plus the offset between the two clocks, which is
    unknown but steady. The least age seen from a client is its fastest trip plus that offset, so
    the age beyond it is what the requests waited more than they had to: their deadlines start
    that much earlier. The least is kept over a sliding window of one to two
    :data:`SEND_WINDOW_S`, so that it follows clocks that drift."""

    def __init__(self, window_s: float = SEND_WINDOW_S) -> None:
        self.window_s = window_s
        self.fastest: dict[str, tuple[float, float, float]] = {}  # client -> (window start, least age in it, in the window before)

    def delay(self, client: str, sent_at: float | None, now: float) -> float:
        """Seconds a message stamped ``sent_at`` (the client's wall clock), read at ``now`` (the
        scheduler's monotonic clock), waited beyond its client's fastest; 0 for an unstamped one."""
        if sent_at is None:
            return 0.0
        age = time.time() - sent_at
        started, least, before = self.fastest.get(client, (now, age, age))
        if now - started >= 2 * self.window_s:  # quiet for a while: what was seen before is stale
            started, least, before = now, age, age
        elif now - started >= self.window_s:
            started, least, before = now, age, least
        least = min(least, age)
        if age - min(least, before) > CLOCK_STEP_S:
            started, least, before = now, age, age
        self.fastest[client] = (started, least, before)
        return age - min(least, before)

    def forget(self, client: str) -> None:
        self.fastest.pop(client, None)


def sliced_releases(release: Callable[..., None]) -> Callable[..., Awaitable[None]]:
    """Dask's ``client-releases-keys`` stream handler, taken :data:`SUBMIT_SLICE` keys at a time
    with the event loop running between two slices.

    A client releases each key in a message of its own, and the scheduler's ``handle_stream``
    runs every message of a batch before the loop turns: when a burst's futures are let go, the
    thousands of releases (each a transition to forgotten) held the scheduler's loop 35-70 ms
    on this 2-core machine (``daskpipe bench runtime``), and every request's dispatch with it.
    ``handle_stream`` awaits a coroutine handler, so the messages of one stream stay in order."""
    turn_started = time.monotonic()

    async def sliced(*, keys: Any, **kwargs: Any) -> None:
        nonlocal turn_started
        if not isinstance(keys, (list, tuple, set)):
            release(keys=keys, **kwargs)  # Dask's own handler says what is wrong
            return
        keys = list(keys)
        for first in range(0, max(1, len(keys)), SUBMIT_SLICE):
            release(keys=keys[first : first + SUBMIT_SLICE], **kwargs)
            if time.monotonic() - turn_started > LOOP_TURN_S:
                await asyncio.sleep(0)
                turn_started = time.monotonic()

    return sliced


def check_feasible(
    model: str, plan: ModelPlan, profile: Profile, budgets: dict[int, float], margin_s: float, *, bw_gbps: float, time_dilation: float
) -> float:
    """Refuse a model whose every entry cannot be served even for a lone request on an idle
    pipeline (batch 1, no queueing) plus the control path's margin: it would drop everything.
    Else the headroom: the least, over its entries, of the budget beyond a lone request's latency,
    the most a margin may take. All times dilated by ``time_dilation`` except the margin, which is
    real time."""
    headroom = float("inf")
    for block, budget in budgets.items():
        paths = [p for p in plan.pipelines if p.entry_block == block]
        if not paths:
            continue
        fastest = min(sum(lone_latency_s(profile, part, bw_gbps) for part in p.partitions) for p in paths)
        if fastest + margin_s > budget:
            smallest_ms = math.ceil((fastest + margin_s) / time_dilation * 1e3 * 10) / 10
            entry = f" entering at block {block}" if block else ""
            raise DeployError(
                f"the SLO of {plan.name!r}{entry}, {budget / time_dilation * 1e3:.1f} ms, cannot be served: a lone request takes "
                f"{fastest / time_dilation * 1e3:.1f} ms on its fastest pipeline and the measured control path "
                f"{margin_s / time_dilation * 1e3:.2f} ms more; the smallest SLO it can serve is {smallest_ms:.1f} ms"
            )
        headroom = min(headroom, budget - fastest)
    return headroom


def lone_latency_s(profile: Profile, part: Any, bw_gbps: float) -> float:
    """Seconds one sample spends in ``part``: its compute at batch 1, and its input's transfer."""
    transfer = profile.bytes_into(part.blocks[0]) * 8 / (bw_gbps * 1e9)
    return profile.latency(part.gpu, part.slices, 1, *part.blocks) * 1e-6 + transfer


def check_dispatcher(name: Any) -> None:
    """Refuse a dispatcher name the registry does not know, listing those it does."""
    try:
        check_name(name)
    except ValueError:
        raise DeployError(f"unknown dispatcher {name!r}; known: {', '.join(known())}") from None


def is_key(key: Any) -> bool:
    """What a daskpipe client sends as a request key (``Service``: strings); Dask takes a few more."""
    return isinstance(key, (str, bytes, int)) and not isinstance(key, bool)


def dilated_plan(model: ModelPlan, k: float) -> ModelPlan:
    """The plan with every latency and the SLO scaled by ``k`` (throughputs by 1/k)."""
    if k == 1.0:
        return model
    pipelines = tuple(
        replace(
            p,
            throughput=p.throughput / k,
            slo_us=None if p.slo_us is None else p.slo_us * k,
            partitions=tuple(replace(q, latency_us=q.latency_us * k, transfer_us=q.transfer_us * k) for q in p.partitions),
        )
        for p in model.pipelines
    )
    return replace(model, slo_us=model.slo_us * k, throughput=model.throughput / k, pipelines=pipelines)


def dilated(model: ModelPlan, profile: Profile, k: float) -> tuple[ModelPlan, Profile]:
    """The plan and profile with every latency and the SLO scaled by ``k`` (throughputs by 1/k)."""
    if k == 1.0:
        return model, profile
    tables = {key: table * k for key, table in profile.latency_us.items()}
    return dilated_plan(model, k), replace(profile, slo_us=profile.slo_us * k, latency_us=tables)


def check_dilation(time_dilation: Any) -> None:
    if not time_dilation > 0:
        raise DeployError(f"time_dilation must be > 0, got {time_dilation!r}")


def pool_dispatcher(
    dispatcher: str,
    plan: dict,
    profiles: dict[str, dict],
    slots: Sequence[WorkerSlot],
    *,
    time_dilation: float,
    timeout_s: float | dict[str, float] | None,
) -> DeferredDispatcher:
    """The one dispatcher of a shared pool: every model of ``profiles`` on every one of ``slots``
    (``daskpipe.sched.registry.make_shared_dispatcher``), time-dilated as :func:`ledger_for`
    dilates; ``timeout_s``: the timeout data plane's wait, one for all models or one each
    (``None``: ``TIMEOUT_S``)."""
    check_dilation(time_dilation)
    check_dispatcher(dispatcher)
    k = float(time_dilation)
    whole = Plan.from_dict(plan)
    models = {name: dilated(whole.model(name), Profile.from_dict(profile), k) for name, profile in profiles.items()}
    try:
        if isinstance(timeout_s, dict):
            wait: float | dict[str, float] = {name: float(s) * k for name, s in timeout_s.items()}
        else:
            wait = k * (TIMEOUT_S if timeout_s is None else float(timeout_s))
        return make_shared_dispatcher(dispatcher, models, [as_slot(s) for s in slots], timeout_s=wait)
    except ValueError as exc:
        raise DeployError(str(exc)) from None


def join_pool_dispatcher(
    shared: DeferredDispatcher,
    model: str,
    plan: dict,
    profile: dict,
    slots: Sequence[WorkerSlot],
    *,
    time_dilation: float,
    timeout_s: float | None,
) -> None:
    """``model`` joins ``shared``, the dispatcher :func:`pool_dispatcher` made for ``slots``, as that
    function would have placed it; ``timeout_s``: its wait on the timeout data plane (default: the
    one the pool's models share)."""
    k = float(time_dilation)
    model_plan, dilated_profile = dilated(Plan.from_dict(plan).model(model), Profile.from_dict(profile), k)
    wait = None if timeout_s is None else float(timeout_s) * k
    try:
        add_shared_model(shared, model, model_plan, dilated_profile, [as_slot(s) for s in slots], max_wait_s=wait)
    except ValueError as exc:
        raise DeployError(str(exc)) from None


def as_slot(slot: WorkerSlot) -> Slot:
    """What a dispatcher knows of a worker's slot."""
    return Slot(id=slot.address, gpu=slot.gpu, slices=slot.slices, server=slot.server)


def placement_of(model: str, stages: Mapping[tuple[int, int, str], str], slots: Mapping[str, WorkerSlot]) -> Placement:
    """Where ``model``'s ``stages`` ((pipeline, partition, address) -> actor key) are, as its
    dispatcher and the dashboard see it; a :class:`DeployError` for a stage on no worker of ``slots``."""
    pools: dict[tuple[int, int], list[str]] = {}
    for p, q, address in stages:
        if address not in slots:
            raise DeployError(f"stage ({p}, {q}) of {model!r} is placed on {address}, which is not a worker of this cluster")
        pools.setdefault((p, q), []).append(address)
    return Placement(
        model=model,
        pools={pool: tuple(sorted(addresses)) for pool, addresses in pools.items()},
        slots={a: as_slot(slots[a]) for _, _, a in stages},
    )


def ledger_for(
    model: str,
    plan: dict,
    profile: dict,
    stages: list[list],
    endings: Endings,
    *,
    control: ControlPath,
    settings: ServeSettings,
    shared: Dispatcher | None = None,
    sample_nbytes: int,
) -> tuple[Ledger, Placement]:
    """The ledger of ``model`` served on ``stages`` (rows of [pipeline, partition, worker address,
    actor key]) among ``endings.slots`` as ``settings`` say, its requests to end through
    ``endings``, with its dispatcher's placement; a model that cannot be served is refused with the
    reason (:func:`check_feasible`). ``control``'s cap is set for it. Its dispatcher is built here
    for this model alone (``settings.dispatcher``), or is ``shared``: one that other models share
    too (a shared pool, :func:`pool_dispatcher`)."""
    time_dilation, bw_gbps = settings.time_dilation, settings.bw_gbps
    check_dilation(time_dilation)
    if shared is None:
        check_dispatcher(settings.dispatcher)
    try:
        gray = GrayPolicy.from_config()
    except ConfigError as exc:
        raise DeployError(f"the scheduler's Dask config: {exc}") from None
    k = float(time_dilation)
    whole_plan = Plan.from_dict(plan)  # co-located stages: the dispatcher plans with their latencies
    model_plan, model_profile = dilated(whole_plan.model(model), colocated_profile(Profile.from_dict(profile), whole_plan), k)
    stage_keys = {(int(p), int(q), str(a)): str(key) for p, q, a, key in stages}
    placement = placement_of(model, stage_keys, endings.slots)
    slot_of = {a: endings.slots[a] for _, _, a in stage_keys}
    budgets = {block: us * 1e-6 for block, us in model_plan.entry_slo_us().items()}
    headroom = check_feasible(model, model_plan, model_profile, budgets, control.margin_s, bw_gbps=float(bw_gbps) / k, time_dilation=k)
    control.cap_s = MAX_SHARE * min(min(budgets.values()), headroom)  # a lone request always stays servable, with room to queue
    control.refresh(time.monotonic())
    ledger = Ledger(
        model=model_plan,
        profile=model_profile,
        dispatcher=make_dispatcher(
            settings.dispatcher, model_plan, placement, model_profile, bw_gbps=float(bw_gbps) / k, timeout_s=TIMEOUT_S * k
        )
        if shared is None
        else shared,
        stages=stage_keys,
        emulated=frozenset(a for a, s in slot_of.items() if s.emulated),
        durations=BatchDurations(
            model_plan, model_profile, bw_gbps=float(bw_gbps) / k, colocated=colocated_latency(whole_plan, model, scale=k)
        ),
        endings=endings,
        max_queued=queue_bound(model_plan, settings.max_queued),
        sample_nbytes=int(sample_nbytes),
        budgets=budgets,
        control=control,
        gray=gray,
    )
    return ledger, placement


class Intake:
    """Takes clients' submissions on the scheduler's loop: checks them, makes keys of what can be
    served, queues them and steps the dispatcher; refuses the rest on arrival."""

    def __init__(self, models: Models, links: Links) -> None:
        self.models = models
        self.links = links
        self.send_clocks = SendClocks()

    async def on_submit(self, client: str, **fields: Any) -> None:
        """New requests from ``client`` (a SUBMIT message's ``fields``: :class:`~daskpipe.runtime.wire.messages.Submission`):
        make their keys, queue them, step the dispatcher.

        ``start_block`` > 0: hybrid requests entering mid-model, each with its entry's budget.
        ``sent_at``: the client's wall clock when the caller handed the requests over; their
        deadlines count from then (:class:`SendClocks`), else from the scheduler reading them.
        The message is checked whole before any key is made, so a malformed one errs every one of
        its futures at once; then it is taken :data:`SUBMIT_SLICE` requests at a time (a message
        refused whole :data:`REFUSAL_SLICE` keys at a time), the event loop running whatever
        waits between two slices, whatever the message's size."""
        try:
            keys = fields.get("keys")
            if not isinstance(keys, (list, tuple)):
                logger.warning("daskpipe: client %s sent a submission without a list of keys (%s); ignored", client, type(keys).__name__)
                return
            model = fields.get("model")
            problem: str | None = None
            try:
                submission = read_submission(fields)
            except MalformedSubmission as exc:
                problem = str(exc)
            ledger = self.models.ledgers.get(submission.model) if problem is None else None
            if problem is None and ledger is not None and not ledger.closing and submission.start_block not in ledger.budgets:
                problem = (
                    f"model {model!r} takes no requests entering at block {submission.start_block!r}; its plan has entries at "
                    f"{sorted(ledger.budgets)}"
                )
            read_at = time.monotonic()
            arrival = read_at
            if problem is None and ledger is not None:
                delay = self.send_clocks.delay(client, submission.sent_at, read_at)
                ledger.control.record_send(delay, len(keys))
                arrival -= delay
            first = 0
            while first < len(keys):
                if first:
                    await asyncio.sleep(0)
                    ledger = self.models.ledgers.get(submission.model) if problem is None else None  # it may have closed meanwhile
                if problem is None and ledger is not None and not ledger.closing:
                    stop = first + SUBMIT_SLICE
                    self._submit_slice(
                        client,
                        submission.model,
                        ledger,
                        keys[first:stop],
                        submission.inputs[first:stop],
                        submission.sizes[first:stop],
                        submission.start_block,
                        arrival,
                    )
                else:
                    stop = first + REFUSAL_SLICE
                    refusal = (
                        ("invalid", f"malformed submission to model {model!r}: {problem}", "")
                        if problem is not None
                        else ("dropped", "" if ledger else "no service serves this model", "shutdown")
                    )
                    sliced = keys[first:stop]
                    usable = [sliced[i] for i in self._usable(client, model, sliced)]
                    refuse(self.models.scheduler, self.links.client_streams, client, model, [(*refusal, usable)])
                first = stop
            self.models.arm()
        except Exception:
            logger.exception("daskpipe: a submission from client %s failed", client)

    def _usable(self, client: str, model: Any, keys: Sequence) -> list[int]:
        """The indices of those of ``keys`` that can name a new request: keys, and not in use (a
        warning for the others)."""
        tasks = self.models.scheduler.tasks
        usable = [i for i, k in enumerate(keys) if is_key(k) and k not in tasks]
        if len(usable) < len(keys):
            logger.warning(
                "daskpipe: %d request keys of %r from client %s are already in use or not keys; ignored",
                len(keys) - len(usable),
                model,
                client,
            )
        return usable

    def _submit_slice(
        self, client: str, model: str, ledger: Ledger, keys: Sequence, inputs: Any, sizes: Any, start_block: int, arrival: float
    ) -> None:
        """Refuse what cannot be served before it becomes a key (:func:`~daskpipe.runtime.scheduler.keys.refuse`);
        make keys of, queue and dispatch the rest, their deadlines counted from ``arrival``."""
        models, links = self.models, self.links
        now = time.monotonic()
        invalid: dict[str, list] = {}  # why -> the keys refused for it: a flood of one mistake is one refusal
        overload = f"{ledger.max_queued} requests queued (max_queued)"
        overloaded: list = []
        accepted: list[tuple[Any, Any, int]] = []
        room = ledger.max_queued - len(ledger.queued)
        for i in self._usable(client, model, keys):
            key, payload, size = keys[i], inputs[i], sizes[i]
            if held_count(payload):  # the client keeps the input; the first stage will fetch it
                payload = HeldInput(client, payload)
            refusal = ledger.refusal(payload, size, start_block)
            if refusal is not None:
                invalid.setdefault(refusal, []).append(key)
            elif len(accepted) >= room:
                overloaded.append(key)
            else:
                accepted.append((key, payload, size))
        refused = sum(map(len, invalid.values()))
        ledger.refuse(refused, len(overloaded), overload)
        refusals: list[Refusal] = [
            ("invalid", f"a request of model {model!r} refused by the scheduler: {why}", "", alike) for why, alike in invalid.items()
        ]
        refuse(models.scheduler, links.client_streams, client, model, [*refusals, ("dropped", overload, "overload", overloaded)])
        if accepted:  # its streams to the stages' workers open before the first fetch, and before the first outputs
            links.reach(client, sorted({address for _, _, address in ledger.stages}))
        make_keys(models.scheduler, client, [key for key, _, _ in accepted])
        control = ledger.control
        deadline, tolerance = arrival + ledger.budgets[start_block] - control.margin_s, control.tolerance_s
        for key, payload, size in accepted:
            ledger.admit(key, payload, size, arrival + ledger.budgets[start_block])
            request = Request(
                id=key, model=model, arrival=arrival, deadline=deadline, size=size, start_block=start_block, tolerance=tolerance
            )
            models.act(ledger, model, ledger.step(lambda: ledger.dispatcher.submit(request, now), failing=[key]))
        models.metrics.submit(model, len(accepted) + refused + len(overloaded), now, len(ledger.queued))

"""The models a scheduler serves: their ledgers by name, the slots they run on, and the one way a
dispatcher's decisions are carried out.

Every dispatcher call (:meth:`~daskpipe.runtime.scheduler.ledger.Ledger.step`) returns actions,
which :meth:`Models.act` carries out: a dispatch is sent (by the batches,
:class:`~daskpipe.runtime.scheduler.batches.Batches`), a drop ends its request in its ledger. A shared
pool's dispatcher decides for several models at once: each action goes to the model it is for.
One wake-up (:class:`~daskpipe.runtime.scheduler.timer.Wakeup`) is kept at the earliest
``next_wake`` of all dispatchers. Losing a worker or a client, and closing a model, end or retry
what they held here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

from daskpipe.runtime.errors import guarded
from daskpipe.runtime.scheduler.ledger import Dropped, Endings, Flight, Ledger, client_gone, worker_lost
from daskpipe.runtime.scheduler.timer import Wakeup
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.messages import WorkerSlot
from daskpipe.sched.api import Dispatch, Dispatcher, Drop, DropReason, Request
from daskpipe.sched.metrics import ServiceMetrics
from daskpipe.sched.symphony import DeferredDispatcher

logger = logging.getLogger(__name__)


class Models:
    """The served models (see the module docstring); runs on the scheduler's loop. ``dispatch``
    sends a dispatcher's batch (the batches' :meth:`~daskpipe.runtime.scheduler.batches.Batches.dispatch`)."""

    def __init__(self, metrics: ServiceMetrics, dispatch: Callable[[Ledger, str, Dispatch], None]) -> None:
        self.metrics = metrics
        self.dispatch = dispatch
        self.ledgers: dict[str, Ledger] = {}  # model -> its ledger: its requests, until each ends
        self.slots: dict[str, WorkerSlot] = {}  # address -> the daskpipe slot its worker is
        self.scheduler: Any = None  # Dask's, from start
        self.endings: Endings | None = None  # what ending a request touches on this scheduler, from start
        self.wakeup = Wakeup(self._on_timer)  # the earliest next_wake of all dispatchers

    def start(self, scheduler: Any, to_worker: Callable[[str, dict], None]) -> None:
        self.scheduler = scheduler
        self.endings = Endings(scheduler, self.slots, to_worker, self.metrics)

    def inventory(self) -> list[dict]:
        """The slots a plan may use: the daskpipe workers if any, else every worker as a CPU slot."""
        gpu_slots = [s for s in self.slots.values() if s.gpu != messages.CPU or s.emulated]
        slots = gpu_slots or list(self.slots.values())
        return [s.to_msg() for s in sorted(slots, key=lambda s: s.address)]

    # -- carrying out the dispatchers' decisions -----------------------------------------------
    def act(self, ledger: Ledger, model: str, actions: list) -> None:
        """Carry out what a dispatcher call returned: send its batches, end what it dropped."""
        for action in actions:
            owner = action.model if isinstance(action, Dispatch) else action.request.model
            target = ledger if owner == model else self.ledgers[owner]
            if isinstance(action, Dispatch):
                self.dispatch(target, owner, action)
            elif isinstance(action, Drop) and action.request.id in target.queued:  # else it ended already (released)
                target.end([action.request.id], Dropped(action.reason, action.detail))

    def remove_slot(self, ledger: Ledger, model: str, address: str, now: float, reason: DropReason) -> None:
        """Take ``address`` out of the dispatcher's pools; a dispatcher whose pools are fixed
        (``supports_pools`` false) keeps it, and what it still sends there is dropped as
        "worker-lost" (:meth:`~daskpipe.runtime.scheduler.batches.Batches.dispatch`) until a re-plan."""
        dispatcher = ledger.dispatcher
        if dispatcher.supports_pools and any(a == address for _, _, a in ledger.stages):
            self.act(ledger, model, ledger.step(lambda: dispatcher.remove_slot(address, now, reason)))

    def retry(self, ledger: Ledger, model: str, flights: list[Flight], now: float, reason: DropReason, why: str) -> None:
        """Queue the requests of ``flights`` again, with their original deadlines; one the retry
        cannot serve is dropped for ``reason``, with ``why`` and the dispatcher's own reason."""
        for flight in flights:
            for request, payload, size in flight.retries:
                key = request.id
                if not ledger.requeue(key, payload, size):  # ended meanwhile, or already queued again
                    continue
                ledger.counts["retried"] = ledger.counts.get("retried", 0) + 1
                retry = replace(request)  # its original deadline
                actions = ledger.step(lambda: ledger.dispatcher.submit(retry, now), failing=[key])
                for action in actions:
                    if isinstance(action, Drop) and action.request.id == key:
                        action.reason, action.detail = reason, f"{why}; the retry was dropped ({action.reason}): {action.detail}"
                self.act(ledger, model, actions)

    def resume(self, model: str, requests: list[Request], dispatcher: Dispatcher | None = None) -> None:
        """Submit the ``requests`` still queued to ``model``'s dispatcher (``dispatcher``, when
        given, first takes charge again: the one :meth:`hold` returned)."""
        ledger = self.ledgers[model]
        if dispatcher is not None:
            ledger.dispatcher = dispatcher
        now = time.monotonic()
        for request in requests:
            if request.id in ledger.queued:  # else it ended meanwhile
                self.act(ledger, model, ledger.step(lambda: ledger.dispatcher.submit(request, now), failing=[request.id]))

    def hold(self, model: str, holding: Dispatcher) -> tuple[Dispatcher, list[Request]]:
        """Put ``holding`` in charge of ``model`` and drain the dispatcher it replaces: returns that
        dispatcher and the queued requests it gave up (they are still in the ledger's care)."""
        ledger = self.ledgers[model]
        old, ledger.dispatcher = ledger.dispatcher, holding
        drained = ledger.step(lambda: old.drain(time.monotonic(), "shutdown"))
        return old, [action.request for action in drained if isinstance(action, Drop)]

    # -- losing a worker or a client, closing ---------------------------------------------------
    def lose_worker(self, worker: str) -> bool:
        """``worker`` left or died: in every model, take its slot out of the dispatcher's pools (its
        reservations are released) and re-dispatch the requests of the batches that ran through it
        while their deadlines allow; a request the retry cannot serve, or whose parked data it held,
        is dropped as "worker-lost", saying why. ``False`` when it was no slot."""
        if self.slots.pop(worker, None) is None:
            return False
        now = time.monotonic()
        for model, ledger in list(self.ledgers.items()):
            lost = [flight for _, flight in ledger.take_flights(worker)]
            if ledger.suspects.pop(worker, None) is None:  # a suspect is out of the pools already
                self.remove_slot(ledger, model, worker, now, "worker-lost")
            ledger.end(
                [key for key, address in ledger.parked.items() if address == worker],
                worker_lost(f"worker {worker} died holding its data between two stages"),
            )
            self.retry(ledger, model, lost, now, "worker-lost", f"worker {worker} died while its batch ran")
        self.arm()
        return True

    def client_left(self, client: str) -> None:
        """``client`` left and Dask released its keys: its queued requests end, dropped as
        "client-gone" (nothing is left of them on the scheduler), and a model whose stage actors it
        held (their keys are gone with it) is closed."""
        tasks = self.scheduler.tasks
        for model, ledger in list(self.ledgers.items()):
            ledger.end([k for k in ledger.queued if k not in tasks], client_gone(f"client {client} left"))
            if not ledger.closing and any(key not in tasks for key in ledger.stages.values()):
                logger.warning("daskpipe: the stage actors of %s were released (client %s left); closing it", model, client)
                self.close([model], reason="shutdown")

    def close(self, models: Iterable[str] | None = None, reason: DropReason = "shutdown") -> dict[str, int]:
        """Stop taking requests for ``models`` (default: all); queued ones err with ``reason``.

        Batches already dispatched run to the end; ``status`` shows them in ``in_flight``.
        """
        now = time.monotonic()
        drained = {}
        for model in list(self.ledgers if models is None else models):
            ledger = self.ledgers.get(model)
            if ledger is None:
                continue
            ledger.closing = True
            actions = ledger.step(lambda: self._drain(ledger, model, now, reason))
            self.act(ledger, model, actions)
            leftover = ledger.end(list(ledger.queued), Dropped(reason))  # anything the dispatcher did not hand back
            drained[model] = len(actions) + len(leftover)
        return drained

    def _drain(self, ledger: Ledger, model: str, now: float, reason: DropReason) -> list:
        """``model``'s queued requests out of its dispatcher; of a shared pool's, only its own
        while other models of the pool are still served."""
        dispatcher = ledger.dispatcher
        staying = any(s.dispatcher is dispatcher and not s.closing for s in self.ledgers.values())
        if staying and isinstance(dispatcher, DeferredDispatcher):
            return dispatcher.drain(now, reason, models=[model])
        return dispatcher.drain(now, reason)

    def status(self, models: Iterable[str] | None = None, forget: bool = False) -> dict[str, dict]:
        """Counters per model; ``forget`` removes closed models whose batches have all ended."""
        out = {}
        for model in list(self.ledgers if models is None else models):
            ledger = self.ledgers.get(model)
            if ledger is None:
                continue
            out[model] = {
                **ledger.counts,
                "dropped": dict(ledger.dropped),
                "queued": len(ledger.queued),
                "max_queued": ledger.max_queued,
                "in_flight": sum(len(f.keys) for f in ledger.flights.values()),
                "closing": ledger.closing,
                "control": ledger.control.summary(),
                "late": ledger.late.summary(),
                "measured_ratios": {f"{p}/{q}": ratio for (p, q), ratio in sorted(ledger.dispatcher.measured_ratios().items())},
                "suspects": ledger.suspect_summaries(),
            }
            if forget and ledger.closing and not ledger.flights:
                del self.ledgers[model]
        return out

    # -- the timer -----------------------------------------------------------------------------
    def arm(self) -> None:
        """Keep one wake-up (:class:`~daskpipe.runtime.scheduler.timer.Wakeup`), at the earliest ``next_wake`` of all dispatchers."""
        wakes = [w for s in self.ledgers.values() if (w := s.dispatcher.next_wake()) is not None]
        wake = min(wakes, default=float("inf"))
        if wake < self.wakeup.at:
            self.wakeup.arm(wake)
        elif wake == float("inf"):
            self.wakeup.cancel()

    @guarded
    def _on_timer(self) -> None:
        now = time.monotonic()
        margins: dict[int, float] = {}  # a shared pool's dispatcher: the least margin of its models
        for ledger in self.ledgers.values():
            key = id(ledger.dispatcher)
            margins[key] = min(margins.get(key, ledger.control.margin_s), ledger.control.margin_s)
        for model, ledger in list(self.ledgers.items()):
            if id(ledger.dispatcher) not in margins:  # a shared pool's, woken already
                continue
            wake = ledger.dispatcher.next_wake()
            if wake is not None and wake <= now:
                # a wake that fires late by up to the margin is given the time it asked for: the margin
                # pays for it (a late timer is part of the measured dispatch delay); else a dispatcher
                # waiting for a batch's last moment would find it just past, and drop the batch
                at = max(wake, now - margins.pop(id(ledger.dispatcher)))
                self.act(ledger, model, ledger.step(lambda: ledger.dispatcher.wake(at)))
            else:
                margins.pop(id(ledger.dispatcher))
        self.arm()

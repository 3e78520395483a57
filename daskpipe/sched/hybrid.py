"""The data plane of a hybrid (fragment) plan: one PPipe dispatcher per entry block, one timeline.

A hybrid model's plan has a pipeline per fragment route, entering at the fragment's start block
(``Pipeline.entry_block``): a private stage ``[k, p)`` then the shared stage ``[p, N)``, whose
pool appears in every route through it. :class:`FragmentDispatcher` serves such a model behind
the ordinary :class:`~daskpipe.sched.api.Dispatcher` interface, so the scheduler plugin steps it
like any other:

* a request goes to the PPipe dispatcher of its ``start_block``, which batches it only with
  requests entering at the same block (their tensors have the same shape) and plans their whole
  route, shared stage included;
* **reservations stay consistent because the sub-dispatchers share one timeline**: the shared
  stage's slots are the same resources in all of them, so a batch one entry reserves there is
  seen by every other entry's next probe, and no two entries plan the same slot time twice. Each
  entry reserves the shared slot as if its batch ran alone; when the shared stage's actor merges
  batches that arrived while its slot was busy (:class:`~daskpipe.runtime.client.hybrid.SharedStage`),
  it reports the merged run's real interval for each of them, and the timeline corrections
  collapse their back-to-back reservations onto it, freeing the time the merge saved;
* dispatch ids are unique across entries (entry ``i`` of ``n`` numbers its dispatches
  ``i, i + n, i + 2n, ...``), so a reservation token names one batch on a shared slot and
  feedback finds its entry by ``dispatch % n``; pipeline indices are the plan's, not the entry's.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Action, Dispatch, Dispatcher, DropReason, Feedback, Placement, Request, Slot, Time
from daskpipe.sched.ppipe import PPipeDispatcher, PPipeSettings
from daskpipe.sched.timeline import make_timeline


class _EntryDispatcher(PPipeDispatcher):
    """PPipe over the pipelines of one entry block, numbering its dispatches ``first + k * stride``."""

    def __init__(self, *args: object, first_id: int, stride: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._stride = stride
        self.continue_ids(first_id)

    def continue_ids(self, first: int) -> None:
        self._dispatch_ids = count(first, self._stride)


class FragmentDispatcher(Dispatcher):
    """Routes each request by its ``start_block`` to that entry's PPipe dispatcher (module docstring).

    Built as every data plane is (:func:`daskpipe.sched.registry.make_dispatcher`);
    ``model_plan.pipelines`` carry their ``entry_block`` and ``slo_us`` budgets.
    """

    supports_pools = True

    def __init__(
        self, model: ModelPlan, placement: Placement, profile: Profile, *, bw_gbps: float, settings: PPipeSettings | None = None
    ) -> None:
        if not model.pipelines:
            raise ValueError(f"the plan of {model.name!r} has no pipeline")
        settings = settings or PPipeSettings()
        self.timeline = make_timeline(settings.timeline)
        self.model = model
        self.entry_blocks = sorted({p.entry_block for p in model.pipelines})
        budgets = model.entry_slo_us()
        stride = len(self.entry_blocks)
        self._entries: list[_EntryDispatcher] = []
        self._pipelines: list[list[int]] = []  # per entry: local pipeline index -> the plan's
        self._slots: list[set[str]] = []  # per entry: the slots its pools use
        for index, block in enumerate(self.entry_blocks):
            indices = [i for i, p in enumerate(model.pipelines) if p.entry_block == block]
            pools = {
                (local, q): placement.pools[(i, q)]
                for local, i in enumerate(indices)
                for q in range(len(model.pipelines[i].partitions))
                if (i, q) in placement.pools
            }
            self._entries.append(
                _EntryDispatcher(
                    replace(model, slo_us=budgets[block], pipelines=tuple(model.pipelines[i] for i in indices)),
                    Placement(model=model.name, pools=pools, slots=placement.slots),
                    profile,
                    bw_gbps=bw_gbps,
                    settings=settings,
                    timeline=self.timeline,
                    first_id=index,
                    stride=stride,
                )
            )
            self._pipelines.append(indices)
            self._slots.append({slot for pool in pools.values() for slot in pool})

    def entry_of(self, dispatch: int) -> int:
        """The entry block whose requests dispatch ``dispatch`` carries."""
        return self.entry_blocks[dispatch % len(self.entry_blocks)]

    # -- Dispatcher interface ------------------------------------------------------------------
    def submit(self, request: Request, now: Time) -> list[Action]:
        if request.start_block not in self.entry_blocks:
            raise ValueError(
                f"request {request.id!r} enters {self.model.name!r} at block {request.start_block}; the plan has entries "
                f"{self.entry_blocks}"
            )
        index = self.entry_blocks.index(request.start_block)
        request.start_block = 0  # its entry's sub-plan starts there, as PPipe expects; restored on the way out
        return self._global(index, self._entries[index].submit(request, now))

    def wake(self, now: Time) -> list[Action]:
        actions: list[Action] = []
        for index, entry in enumerate(self._entries):
            wake = entry.next_wake()
            if wake is not None and wake <= now:
                actions.extend(self._global(index, entry.wake(now)))
        return actions

    def feedback(self, fb: Feedback, now: Time) -> list[Action]:
        index = fb.dispatch % len(self._entries)
        return self._global(index, self._entries[index].feedback(fb, now))

    def next_wake(self) -> Time | None:
        return min((w for entry in self._entries if (w := entry.next_wake()) is not None), default=None)

    def drain(self, now: Time, reason: DropReason = "shutdown") -> list[Action]:
        return [action for index, entry in enumerate(self._entries) for action in self._global(index, entry.drain(now, reason))]

    @property
    def queued(self) -> int:
        return sum(entry.queued for entry in self._entries)

    def remove_slot(self, slot_id: str, now: Time, reason: DropReason = "worker-lost") -> list[Action]:
        """``slot_id`` is gone: every entry whose pools use it plans nothing more on it (PPipe's ``remove_slot``)."""
        users = [index for index, slots in enumerate(self._slots) if slot_id in slots]
        if not users:
            raise ValueError(f"{slot_id!r} is not a slot of {self.model.name!r}'s pools")
        actions: list[Action] = []
        for index in users:
            self._slots[index].discard(slot_id)
            actions.extend(self._global(index, self._entries[index].remove_slot(slot_id, now, reason)))
        return actions

    def add_slot(self, slot: Slot, pipeline: int, partition: int, now: Time) -> list[Action]:
        """Grow the plan's pool (``pipeline``, ``partition``) by ``slot``, in the entry that owns it."""
        index = next((i for i, indices in enumerate(self._pipelines) if pipeline in indices), None)
        if index is None:
            raise ValueError(f"model {self.model.name!r} has no pipeline {pipeline}")
        actions = self._entries[index].add_slot(slot, self._pipelines[index].index(pipeline), partition, now)
        self._slots[index].add(slot.id)
        return self._global(index, actions)

    def continue_ids(self, first: int) -> None:
        """Number from the first multiple of the entry count at or past ``first``, so that
        ``dispatch % entries`` still names the entry."""
        stride = len(self._entries)
        base = first + (-first) % stride
        for index, entry in enumerate(self._entries):
            entry.continue_ids(base + index)

    def _global(self, index: int, actions: list[Action]) -> list[Action]:
        """Entry ``index``'s actions as the plan sees them: its pipeline indices, and requests
        carrying their entry block again (a retry re-enters where the request first did)."""
        block = self.entry_blocks[index]
        for action in actions:
            if isinstance(action, Dispatch):
                action.pipeline = self._pipelines[index][action.pipeline]
                for request in action.requests:
                    request.start_block = block
            else:
                action.request.start_block = block
        return actions

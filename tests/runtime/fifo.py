"""A small greedy dispatcher for the runtime's tests: they exercise the Dask machinery, not policy.

FIFO over the first pipeline: a batch goes when the planned batch size is queued or the head has
waited ``window`` of its slack; each hop takes the pool slot free soonest. A request whose
deadline cannot be met even alone is dropped ("deadline"); a queue past ``max_queue`` drops
("overload").
"""

from __future__ import annotations

from collections import deque
from itertools import count

from daskpipe.plan.schema import ModelPlan
from daskpipe.profiles.model import Profile
from daskpipe.sched.api import Action, Dispatch, Dispatcher, Drop, Hop, Placement, Request, Reservation, Time


class FifoDispatcher(Dispatcher):
    def __init__(
        self, model: ModelPlan, placement: Placement, profile: Profile, *, bw_gbps: float, window: float = 0.25, max_queue: int = 10_000
    ):
        self.model = model
        self.pipeline = model.pipelines[0]
        self.pools = [placement.pools[(0, q)] for q in range(len(self.pipeline.partitions))]
        self.profile = profile
        self.window = window
        self.max_queue = max_queue
        self.free_at = {slot: 0.0 for pool in self.pools for slot in pool}
        self.queue: deque[Request] = deque()
        self.ids = count()

    def latency(self, q: int, samples: int) -> float:
        part = self.pipeline.partitions[q]
        samples = min(samples, self.profile.max_batch(part.gpu, part.slices))
        return self.profile.latency(part.gpu, part.slices, samples, *part.blocks) * 1e-6

    def submit(self, request: Request, now: Time) -> list[Action]:
        if len(self.queue) >= self.max_queue:
            return [Drop(request, "overload", f"{len(self.queue)} queued")]
        self.queue.append(request)
        return self.wake(now)

    def wake(self, now: Time) -> list[Action]:
        actions: list[Action] = []
        while self.queue:
            head = self.queue[0]
            alone = now + sum(self.latency(q, head.size) for q in range(len(self.pools)))
            if alone > head.deadline:
                actions.append(Drop(self.queue.popleft(), "deadline", f"needs {alone - now:.3f}s"))
                continue
            if sum(r.size for r in self.queue) < self.pipeline.batch_size and now < self._due(head):
                break
            batch, samples = [], 0
            while self.queue and samples + self.queue[0].size <= self.pipeline.batch_size:
                samples += self.queue[0].size
                batch.append(self.queue.popleft())
            actions.append(self._dispatch(batch, samples, now))
        return actions

    def _due(self, head: Request) -> Time:
        return head.arrival + self.window * (head.deadline - head.arrival)

    def _dispatch(self, batch: list[Request], samples: int, now: Time) -> Dispatch:
        hops, ready = [], now
        for q, pool in enumerate(self.pools):
            slot = min(pool, key=self.free_at.__getitem__)
            start = max(ready, self.free_at[slot])
            end = start + self.latency(q, samples)
            self.free_at[slot] = ready = end
            hops.append(Hop(q, slot, Reservation(slot, start, end)))
        return Dispatch(next(self.ids), self.model.name, 0, samples, batch, tuple(hops))

    def continue_ids(self, first: int) -> None:
        self.ids = count(first)

    def next_wake(self) -> Time | None:
        return self._due(self.queue[0]) if self.queue else None

    def drain(self, now: Time, reason="shutdown") -> list[Action]:
        drops = [Drop(r, reason) for r in self.queue]
        self.queue.clear()
        return drops

    @property
    def queued(self) -> int:
        return len(self.queue)

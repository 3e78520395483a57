"""Reservation timelines: when each resource (a slot, a server's NIC uplink or downlink) is busy.

PPipe's paper keeps a table of reserved intervals per resource and looks for the earliest slot
where all the resources a step needs are free together, filling gaps (digest §3.4). The published
simulator keeps one "reserved till" stamp per resource and only appends (digest §3.6). Both are
here, behind one interface, so the dispatcher can run either and the difference can be measured:

* :class:`GapTimeline` — sorted interval lists; ``earliest_slot`` back-fills gaps. Intervals that
  ended before the horizon (``advance(now)``) are pruned when their resource is looked up for a
  change, or reserved while it holds 8 intervals, so memory is bounded by the reservations still
  in the future plus 8 per resource.
* :class:`AppendTimeline` — one stamp per resource; a new reservation starts at or after it. O(1)
  everything and constant memory per resource.

Reservations carry a ``token`` (any hashable, unique per resource) so that a cancelled dispatch
can be released and feedback can correct the reservation it belongs to, even after earlier
corrections shifted it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, bisect_right
from typing import Hashable, Literal, Sequence

from daskpipe.sched.api import Time

TimelineMode = Literal["gaps", "append"]
TIMELINE_MODES: tuple[str, ...] = ("gaps", "append")
NEVER = float("-inf")  # the tail of a resource with nothing reserved
_EPS = 1e-9  # seconds; float noise tolerated when checking that reservations do not overlap
_PRUNE_AFTER = 8  # intervals a gap table may hold before a reservation prunes the ended ones


class Timeline(ABC):
    """Reservation tables for any number of resources (named by strings, created on first use)."""

    mode: TimelineMode

    def __init__(self) -> None:
        self.horizon: Time = NEVER
        self.corrections = 0
        """How many ``correct`` calls changed a table. Until it moves, every reservation is where
        it was made, so on-time feedback needs no lookup (shared by all who use the timeline)."""

    def advance(self, now: Time) -> None:
        """Nothing will be asked about times before ``now`` any more; older intervals may go."""
        if now > self.horizon:
            self.horizon = now

    @abstractmethod
    def earliest(self, resource: str, t: Time, duration: Time) -> Time:
        """Earliest start >= ``t`` at which ``resource`` is free for ``duration``."""

    @abstractmethod
    def earliest_pair(self, first: str, second: str, t: Time, duration: Time) -> Time:
        """Earliest start >= ``t`` at which both resources are free for ``duration`` together
        (a transfer: the sender's uplink and the receiver's downlink)."""

    def earliest_slot(self, resources: Sequence[str], t: Time, duration: Time) -> Time:
        """Earliest start >= ``t`` at which all ``resources`` are free for ``duration`` together."""
        if duration < 0:
            raise ValueError(f"duration must be >= 0, got {duration}")
        moved = True
        while moved:
            moved = False
            for resource in resources:
                start = self.earliest(resource, t, duration)
                if start != t:
                    t, moved = start, True
        return t

    @abstractmethod
    def reserve(self, resource: str, start: Time, end: Time, token: Hashable = None) -> None:
        """Hold ``resource`` over [start, end); raises ``ValueError`` if that overlaps a reservation."""

    @abstractmethod
    def release(self, resource: str, start: Time, end: Time, token: Hashable = None) -> bool:
        """Give back a reservation that will not be used (cancelled dispatch, lost worker).

        Returns whether the table changed."""

    @abstractmethod
    def correct(self, resource: str, reserved: tuple[Time, Time], actual: tuple[Time, Time], token: Hashable = None) -> bool:
        """Feedback: the reservation ``token`` (planned over ``reserved``) really ran over ``actual``.

        A late end pushes the reservations after it that it now overlaps (a worker runs its
        batches in order); an early end frees the rest of the interval. Returns whether the table
        changed."""

    @abstractmethod
    def has_gap(self, resource: str, length: Time) -> bool:
        """Whether ``resource`` has a free gap of at least ``length`` after the horizon and before
        its tail. When it has none, no work can start on it before its tail."""

    @abstractmethod
    def tail(self, resource: str) -> Time:
        """When the last reservation of ``resource`` ends (``NEVER`` if it has none)."""

    @abstractmethod
    def intervals(self, resource: str) -> list[tuple[Time, Time]]:
        """The reservations of ``resource`` still kept, in time order (for tests and dashboards)."""

    @abstractmethod
    def stored(self) -> int:
        """How many intervals (or stamps) are kept over all resources: memory, for pruning checks."""


class AppendTimeline(Timeline):
    """One reserved-till stamp per resource, as the artifact's simulator (no gap filling)."""

    mode = "append"

    def __init__(self) -> None:
        super().__init__()
        self._till: dict[str, Time] = {}

    def earliest(self, resource: str, t: Time, duration: Time) -> Time:
        till = self._till.get(resource, NEVER)
        return till if till > t else t

    def earliest_pair(self, first: str, second: str, t: Time, duration: Time) -> Time:
        till = self._till
        return max(t, till.get(first, NEVER), till.get(second, NEVER))

    def earliest_slot(self, resources: Sequence[str], t: Time, duration: Time) -> Time:
        if duration < 0:
            raise ValueError(f"duration must be >= 0, got {duration}")
        till = self._till
        for resource in resources:
            stamp = till.get(resource, NEVER)
            if stamp > t:
                t = stamp
        return t

    def reserve(self, resource: str, start: Time, end: Time, token: Hashable = None) -> None:
        if end < start:
            raise ValueError(f"reservation of {resource!r} ends before it starts: [{start}, {end})")
        till = self._till.get(resource, NEVER)
        if start < till - _EPS:
            raise ValueError(f"{resource!r} is reserved till {till}; an append-only table cannot take [{start}, {end})")
        self._till[resource] = end

    def release(self, resource: str, start: Time, end: Time, token: Hashable = None) -> bool:
        # Only the last reservation can be given back: earlier ones are not remembered. Its start
        # is an upper bound of the previous stamp, so restoring it is safe (never too early).
        if self._till.get(resource) != end:
            return False
        self._till[resource] = start
        return True

    def correct(self, resource: str, reserved: tuple[Time, Time], actual: tuple[Time, Time], token: Hashable = None) -> bool:
        _check_interval(resource, actual)
        till = self._till.get(resource, NEVER)
        late = actual[1] - reserved[1]
        if till <= reserved[1] + _EPS:  # it was the last reservation: the stamp is its end
            new = actual[1]
        elif late > 0:  # later reservations are assumed back to back, so all of them move
            new = till + late
        else:
            return False
        if new == till:
            return False
        self._till[resource] = new
        self.corrections += 1
        return True

    def has_gap(self, resource: str, length: Time) -> bool:
        return False

    def tail(self, resource: str) -> Time:
        return self._till.get(resource, NEVER)

    def intervals(self, resource: str) -> list[tuple[Time, Time]]:
        till = self._till.get(resource)
        return [] if till is None else [(NEVER, till)]

    def stored(self) -> int:
        return len(self._till)


class GapTimeline(Timeline):
    """Sorted, non-overlapping interval lists per resource; ``earliest`` back-fills gaps (paper).

    Cost: ``earliest`` is O(log k + g) for k kept intervals and g intervals skipped; ``reserve``,
    ``release`` and ``correct`` are O(k). k is the number of reservations of one resource that
    are not over yet, a handful in practice.
    """

    mode = "gaps"

    def __init__(self) -> None:
        super().__init__()
        # resource -> [starts, ends, tokens], three parallel lists sorted by time
        self._tables: dict[str, tuple[list[Time], list[Time], list[Hashable]]] = {}

    def earliest(self, resource: str, t: Time, duration: Time) -> Time:
        table = self._tables.get(resource)
        return t if table is None else _fit(table[0], table[1], t, duration)

    def earliest_pair(self, first: str, second: str, t: Time, duration: Time) -> Time:
        tables = self._tables
        a, b = tables.get(first), tables.get(second)
        if a is None or b is None:
            other = b if a is None else a
            return t if other is None else _fit(other[0], other[1], t, duration)
        while True:
            start = _fit(b[0], b[1], _fit(a[0], a[1], t, duration), duration)
            if start == t:
                return t
            t = start

    def _table(self, resource: str) -> tuple[list[Time], list[Time], list[Hashable]]:
        table = self._tables.get(resource)
        if table is None:
            table = self._tables[resource] = ([], [], [])
            return table
        starts, ends, tokens = table
        old = bisect_right(ends, self.horizon)
        if old:
            del starts[:old], ends[:old], tokens[:old]
        return table

    def reserve(self, resource: str, start: Time, end: Time, token: Hashable = None) -> None:
        if not start <= end:
            _check_interval(resource, (start, end))
        table = self._tables.get(resource)
        # prune by batches of _PRUNE_AFTER intervals: cheaper than on every call, memory still bounded
        starts, ends, tokens = self._table(resource) if table is None or len(table[0]) >= _PRUNE_AFTER else table
        i = bisect_right(starts, start)
        if (i and ends[i - 1] > start + _EPS) or (i < len(starts) and starts[i] < end - _EPS):
            raise ValueError(f"reservation [{start}, {end}) of {resource!r} overlaps one already held: {self.intervals(resource)}")
        starts.insert(i, start)
        ends.insert(i, end)
        tokens.insert(i, token)

    def _find(self, resource: str, start: Time, end: Time, token: Hashable) -> int | None:
        starts, ends, tokens = self._table(resource)
        if token is not None:
            for i, held in enumerate(tokens):
                if held == token:
                    return i
            return None
        i = bisect_left(starts, start)
        return i if i < len(starts) and starts[i] == start and ends[i] == end else None

    def release(self, resource: str, start: Time, end: Time, token: Hashable = None) -> bool:
        i = self._find(resource, start, end, token)
        if i is None:
            return False
        starts, ends, tokens = self._tables[resource]
        del starts[i], ends[i], tokens[i]
        return True

    def correct(self, resource: str, reserved: tuple[Time, Time], actual: tuple[Time, Time], token: Hashable = None) -> bool:
        _check_interval(resource, actual)
        start, end = actual
        i = self._find(resource, reserved[0], reserved[1], token)
        starts, ends, tokens = self._tables[resource]
        if i is not None:
            if starts[i] == start and ends[i] == end:
                return False
            del starts[i], ends[i], tokens[i]
        i = bisect_right(starts, start)
        starts.insert(i, start)
        ends.insert(i, end)
        tokens.insert(i, token)
        # The resource was observed busy over ``actual``: what was planned before it has finished...
        if i and ends[i - 1] > start:
            ends[i - 1] = max(start, starts[i - 1])
        # ...and what was planned after it waits for it, each keeping its duration.
        for j in range(i + 1, len(starts)):
            overlap = ends[j - 1] - starts[j]
            if overlap <= 0:
                break
            starts[j] += overlap
            ends[j] += overlap
        self.corrections += 1
        return True

    def has_gap(self, resource: str, length: Time) -> bool:
        table = self._tables.get(resource)
        if not table:
            return False
        starts, ends, _ = table
        free_from = self.horizon
        for i in range(bisect_right(ends, free_from), len(starts)):
            if starts[i] - free_from >= length:
                return True
            free_from = ends[i]
        return False

    def tail(self, resource: str) -> Time:
        table = self._tables.get(resource)
        return table[1][-1] if table and table[1] else NEVER

    def intervals(self, resource: str) -> list[tuple[Time, Time]]:
        table = self._tables.get(resource)
        return [] if table is None else list(zip(table[0], table[1]))

    def stored(self) -> int:
        return sum(len(table[0]) for table in self._tables.values())


def make_timeline(mode: str) -> Timeline:
    """The timeline for ``mode`` ("gaps": the paper's interval tables; "append": the artifact's stamps)."""
    if mode == "gaps":
        return GapTimeline()
    if mode == "append":
        return AppendTimeline()
    raise ValueError(f"unknown timeline mode {mode!r}; choose one of {', '.join(TIMELINE_MODES)}")


def _fit(starts: list[Time], ends: list[Time], t: Time, duration: Time) -> Time:
    """Earliest start >= ``t`` of ``duration`` between sorted, disjoint intervals."""
    i = bisect_right(ends, t)
    n = len(ends)
    while i < n and starts[i] < t + duration:
        t = ends[i]
        i += 1
    return t


def _check_interval(resource: str, interval: tuple[Time, Time]) -> None:
    if not interval[0] <= interval[1]:
        raise ValueError(f"interval of {resource!r} must have start <= end, got [{interval[0]}, {interval[1]})")

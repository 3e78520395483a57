"""Reservation timelines: gap filling vs append-only, release, feedback correction, pruning."""

from __future__ import annotations

import pytest

from daskpipe.sched.timeline import NEVER, AppendTimeline, GapTimeline, make_timeline


def test_gaps_fill_holes_append_does_not():
    gaps, append = GapTimeline(), AppendTimeline()
    for tl in (gaps, append):
        tl.reserve("g", 0.0, 1.0)
        tl.reserve("g", 3.0, 4.0)
    assert gaps.earliest("g", 0.5, 1.5) == 1.0  # [1, 2.5) fits before 3
    assert gaps.earliest("g", 0.5, 2.5) == 4.0  # does not fit in the hole
    assert append.earliest("g", 0.5, 1.5) == 4.0
    assert gaps.earliest("idle", 7.0, 1.0) == append.earliest("idle", 7.0, 1.0) == 7.0


@pytest.mark.parametrize("mode", ["gaps", "append"])
def test_earliest_slot_needs_all_resources_free_together(mode):
    tl = make_timeline(mode)
    tl.reserve("ul", 0.0, 2.0)
    tl.reserve("dl", 2.5, 3.0)
    assert tl.earliest_slot(["ul", "dl"], 0.0, 1.0) == 3.0  # the gap [2, 2.5) is too short
    assert tl.earliest_pair("ul", "dl", 0.0, 0.4) == (2.0 if mode == "gaps" else 3.0)


def test_gaps_reserve_refuses_overlap_and_unknown_mode():
    tl = GapTimeline()
    tl.reserve("g", 1.0, 2.0)
    with pytest.raises(ValueError, match="overlaps"):
        tl.reserve("g", 1.5, 2.5)
    with pytest.raises(ValueError, match="start <= end"):
        tl.reserve("g", 3.0, 2.5)
    with pytest.raises(ValueError, match="unknown timeline mode"):
        make_timeline("lanes")
    with pytest.raises(ValueError, match="append-only"):
        append = AppendTimeline()
        append.reserve("g", 1.0, 2.0)
        append.reserve("g", 1.5, 3.0)


def test_release_gives_time_back():
    gaps, append = GapTimeline(), AppendTimeline()
    for tl in (gaps, append):
        tl.reserve("g", 0.0, 1.0, token="a")
        tl.reserve("g", 1.0, 2.0, token="b")
    assert gaps.release("g", 0.0, 1.0, token="a")
    assert gaps.intervals("g") == [(1.0, 2.0)]
    assert not append.release("g", 0.0, 1.0, token="a")  # not the last: append tables cannot free it
    assert append.release("g", 1.0, 2.0, token="b")
    assert append.tail("g") == 1.0


def test_gaps_feedback_late_pushes_following_reservations():
    tl = GapTimeline()
    tl.reserve("g", 0.0, 1.0, token=1)
    tl.reserve("g", 1.0, 2.0, token=2)
    tl.reserve("g", 2.5, 3.0, token=3)
    tl.reserve("g", 5.0, 6.0, token=4)
    assert tl.correct("g", (0.0, 1.0), (0.0, 1.8), token=1)
    # 2 moves to [1.8, 2.8), which pushes 3 to [2.8, 3.3); 4 is far enough and stays
    assert tl.intervals("g") == [(0.0, 1.8), (1.8, 2.8), (2.8, pytest.approx(3.3)), (5.0, 6.0)]
    # later feedback still finds a shifted reservation by its token
    assert tl.correct("g", (1.0, 2.0), (1.8, 2.7), token=2)
    assert tl.intervals("g")[1] == (1.8, 2.7)


def test_gaps_feedback_early_frees_the_rest():
    tl = GapTimeline()
    tl.reserve("g", 0.0, 2.0, token=1)
    tl.reserve("g", 3.0, 4.0, token=2)
    assert tl.correct("g", (0.0, 2.0), (0.0, 1.0), token=1)
    assert tl.earliest("g", 0.0, 2.0) == 1.0
    assert not tl.correct("g", (3.0, 4.0), (3.0, 4.0), token=2)  # on time: nothing changes


def test_append_feedback():
    tl = AppendTimeline()
    tl.reserve("g", 0.0, 1.0)
    tl.reserve("g", 1.0, 2.0)
    assert tl.correct("g", (0.0, 1.0), (0.0, 1.5))  # late, not the last: everything after moves
    assert tl.tail("g") == 2.5
    assert tl.correct("g", (1.5, 2.5), (1.5, 2.2))  # the last one ended early
    assert tl.tail("g") == 2.2
    assert not tl.correct("g", (0.0, 1.0), (0.0, 0.9))  # early, not the last: nothing to free
    assert AppendTimeline().tail("x") == NEVER


def test_gaps_prune_keeps_memory_bounded():
    tl = GapTimeline()
    t = 0.0
    for i in range(100_000):
        tl.advance(t)
        start = tl.earliest_slot(["g", "g/ul"], t, 0.001)
        tl.reserve("g", start, start + 0.001, token=i)
        tl.reserve("g/ul", start, start + 0.001, token=i)
        t += 0.001
    assert tl.stored() <= 2 * 8  # two resources, each pruned once it holds 8 intervals

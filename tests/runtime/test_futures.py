"""The state of a served future: Dask's state changes, seen by waiting threads and coroutines alike."""

from __future__ import annotations

import asyncio
import gc

import pytest

from daskpipe.runtime.futures import LandedState


def events_held(state: LandedState) -> int:
    return sum(isinstance(o, asyncio.Event) for o in gc.get_referents(state))


@pytest.mark.parametrize("end", ["finish", "set_error", "cancel"])
def test_a_future_nobody_awaits_ends_without_making_an_event(end):
    """A burst makes thousands of futures, most read by a thread (``result()``): an asyncio event
    each would be two more objects apiece for the client's garbage collector."""
    state = LandedState("k")
    args = {"finish": (), "set_error": (ValueError("boom"), None), "cancel": ()}[end]
    getattr(state, end)(*args)
    assert state.done() and state.wait_landed(0)
    assert events_held(state) == 0


def test_a_coroutine_waits_for_the_end_whether_it_came_before_or_after_it_asked():
    async def main():
        ended = LandedState("ended")
        ended.finish()
        await asyncio.wait_for(ended.wait(), 1)  # ended before anyone waited: at once

        state = LandedState("pending")
        assert not state.done()
        waiter = asyncio.ensure_future(state.wait())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        state.set_error(ValueError("boom"), None)
        await asyncio.wait_for(waiter, 1)
        assert state.done() and state.status == "error"

        state.lose()  # Dask retries a key it lost: pending again, for threads and coroutines
        assert not state.done() and not state.wait_landed(0)
        with pytest.raises(asyncio.TimeoutError):
            await state.wait(timeout=0.01)
        state.finish()
        await asyncio.wait_for(state.wait(), 1)
        assert state.wait_landed(0)

        state.reset()
        assert not state.done()
        with pytest.raises(asyncio.TimeoutError):
            await state.wait(timeout=0.01)

    asyncio.run(main())

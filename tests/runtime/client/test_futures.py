"""The state of a served future: Dask's state changes, seen by waiting threads and coroutines alike;
and how a client's stream hands its messages to the wire."""

from __future__ import annotations

import asyncio
import gc

import pytest

from daskpipe.runtime.client.futures import ClientStream, LandedState
from tests.helpers import LoopTurns


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


def test_a_client_stream_writes_its_first_message_at_once_and_the_rest_one_a_loop_turn():
    """A ``map``'s chunks then reach the scheduler as payloads of their own, each decoded in a
    loop turn of its own there, not as one payload of them all."""

    class LoopOf:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.add_callback = loop.call_soon_threadsafe

    class ClientOf:  # what a ClientStream asks of its client before it opens
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = LoopOf(loop)

    async def main() -> list[tuple[int, int]]:
        turns = LoopTurns()
        turns.start()
        stream = ClientStream(ClientOf(asyncio.get_running_loop()))
        written: list[tuple[int, int]] = []
        stream._out.send = lambda message: written.append((turns.count, message["n"]))  # type: ignore[method-assign]
        await asyncio.sleep(0)
        sent_at = turns.count
        for n in range(4):
            stream.send({"n": n})
        await asyncio.sleep(0.05)
        turns.stop()
        return [(turn - sent_at, n) for turn, n in written]

    written = asyncio.run(main())
    assert [n for _, n in written] == [0, 1, 2, 3]
    assert written[0][0] <= 1 and len({turn for turn, _ in written}) == 4, written

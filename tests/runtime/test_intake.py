"""What comes into the scheduler: a client's releases are taken in slices of the event loop."""

from __future__ import annotations

import asyncio
import time

from daskpipe.runtime.intake import LOOP_TURN_S, SUBMIT_SLICE, sliced_releases


def test_a_burst_of_releases_lets_the_event_loop_turn_and_keeps_their_order():
    released: list = []
    turns_during: list[int] = []

    def release(*, keys, client, stimulus_id=None):  # Dask's handler, as slow as a busy scheduler's transitions
        released.extend(keys)
        time.sleep(LOOP_TURN_S / 4)

    async def main() -> None:
        handler = sliced_releases(release)
        turns = 0

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = turns
        for i in range(40):  # a message per key, as a client sends them, and one message of many keys
            await handler(keys=[f"k{i}"], client="c")
        await handler(keys=[f"many-{j}" for j in range(8 * SUBMIT_SLICE)], client="c")
        turns_during.append(turns - before)
        task.cancel()

    asyncio.run(main())
    assert released == [f"k{i}" for i in range(40)] + [f"many-{j}" for j in range(8 * SUBMIT_SLICE)]
    assert turns_during[0] >= 10, f"the loop turned {turns_during[0]} times in ~{48 * LOOP_TURN_S / 4:.2f} s of releases"


def test_a_malformed_release_reaches_dasks_handler_unchanged():
    seen = []
    asyncio.run(sliced_releases(lambda **kw: seen.append(kw))(keys="not-a-list", client="c"))
    assert seen == [{"keys": "not-a-list", "client": "c"}]

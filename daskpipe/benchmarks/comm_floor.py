"""The floor under a scheduler's CPU per request: a relay over Dask's TCP comm and nothing else.

A request that is not batched takes three control messages through daskpipe's scheduler at the
least: its submission in from its sender, the dispatch out to a worker, and the completion back in
(the last stage answers the sender itself). Three processes of their own (a sender, the relay, a
hold-only worker) carry exactly those over ``distributed.comm`` (one ``comm.write`` a message and
one ``comm.read`` each, as Dask's servers do; the worker answers the sender on a comm of its own),
with Poisson arrivals of the same seeds as ``bench capacity``'s trials. The relay's CPU per
request at each offered rate is what any scheduler built on Dask's comms spends on those three
messages before it does anything else. ``bench capacity --comm-floor`` measures it in the same
run as its ladders.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from daskpipe.benchmarks.processes import cpu_s
from daskpipe.benchmarks.serve import poisson_due, sender_seed

HOLD_S = 0.001
"""How long the worker holds each request before it answers."""

RELAYED_MESSAGES = 3
"""The relay's messages a request: the submission in, the dispatch out, the completion in."""


async def _listen(handler: Any, addresses: Any) -> None:
    """Serve ``handler`` on a fresh TCP port, tell ``addresses`` where, and run until killed."""
    from distributed.comm import listen

    listener = listen("tcp://127.0.0.1:0", handler)
    await listener.start()
    addresses.put(listener.contact_address)
    await asyncio.Event().wait()


def _worker(addresses: Any) -> None:
    """Holds each dispatched request, then answers its sender and tells the relay it is done."""
    senders: dict[str, Any] = {}

    async def complete(relay: Any, keys: list[str]) -> None:
        await asyncio.sleep(HOLD_S)
        for key in keys:
            await senders[key.split("/")[0]].write([{"op": "result", "key": key}])
        await relay.write([{"op": "done", "key": key} for key in keys])

    async def handler(comm: Any) -> None:
        from distributed.comm import CommClosedError

        try:
            first = await comm.read()
            if first[0]["op"] == "hello":  # a sender's comm for its answers
                senders[first[0]["sender"]] = comm
                await comm.write(first)  # registered: the sender may start
                await comm.read()  # until it closes
                return
            messages = first
            while True:
                asyncio.ensure_future(complete(comm, [m["key"] for m in messages]))
                messages = await comm.read()
        except CommClosedError:
            return

    asyncio.run(_listen(handler, addresses))


def _relay(worker_address: str, addresses: Any) -> None:
    """Forwards each submission to the worker and reads the worker's completions."""

    async def main() -> None:
        from distributed.comm import CommClosedError, connect

        to_worker = await connect(worker_address)

        async def completions() -> None:
            while True:
                await to_worker.read()

        async def handler(comm: Any) -> None:
            while True:
                try:
                    messages = await comm.read()
                except CommClosedError:  # the trial's sender has ended
                    return
                await to_worker.write([{"op": "run", "key": m["key"]} for m in messages])

        asyncio.ensure_future(completions())
        await _listen(handler, addresses)

    asyncio.run(main())


def _sender(relay_address: str, worker_address: str, rate: float, seconds: float, seed: int, name: str, results: Any) -> None:
    """One Poisson trial: submissions to the relay, answers from the worker; how many came back."""

    async def main() -> int:
        from distributed.comm import connect

        answers_from = await connect(worker_address)
        await answers_from.write([{"op": "hello", "sender": name}])
        await answers_from.read()
        to_relay = await connect(relay_address)
        due = poisson_due(rate, seconds, seed)
        answered = 0

        async def answers() -> None:
            nonlocal answered
            while answered < len(due):
                answered += len(await answers_from.read())

        reading = asyncio.ensure_future(answers())
        zero = time.perf_counter()
        for i, at in enumerate(due):
            await asyncio.sleep(max(0.0, zero + at - time.perf_counter()))
            await to_relay.write([{"op": "submit", "key": f"{name}/{i}", "sent": time.time()}])
        await asyncio.wait_for(reading, timeout=seconds + 30)
        await to_relay.close()
        await answers_from.close()
        return answered

    results.put(asyncio.run(main()))


def relay_floor(rates: Sequence[float], seconds: float, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Per offered rate, one Poisson trial of ``seconds`` through a fresh sender (its arrivals those
    of a one-sender ``bench capacity`` trial of that seed): the relay's CPU per request."""
    from distributed.utils import get_mp_context

    context = get_mp_context()
    addresses, results = context.Queue(), context.Queue()
    worker = context.Process(target=_worker, args=(addresses,), daemon=True)
    worker.start()
    worker_address = addresses.get(timeout=60)
    relay = context.Process(target=_relay, args=(worker_address, addresses), daemon=True)
    relay.start()
    relay_address = addresses.get(timeout=60)
    figures = []
    try:
        for k, (rate, seed) in enumerate(zip(rates, seeds)):
            args = (relay_address, worker_address, rate, seconds, sender_seed(seed, 0), f"s{k}", results)
            sender = context.Process(target=_sender, args=args, daemon=True)
            before = cpu_s(relay.pid)
            sender.start()
            requests = results.get(timeout=seconds + 90)
            used = cpu_s(relay.pid) - before
            sender.join(30)
            figures.append({"offered_rate_per_s": rate, "requests": requests, "relay_cpu_us_per_request": used * 1e6 / max(requests, 1)})
    finally:
        for process in (relay, worker):
            process.kill()
            process.join(10)
    return figures

"""Requests from a client that did not deploy the models: the load of another client process.

:class:`RemoteSender` sends on a daskpipe stream of its own, as a
:class:`~daskpipe.runtime.client.service.Service` does, without deploying anything; inputs are the raw
bytes a ``Service`` would send for them, held here until the first stage fetches them. :func:`mark_in_hand` times when an output is in hand.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from distributed import Client

from daskpipe.runtime.client.futures import ServedFuture
from daskpipe.runtime.client.service import open_stream


class RemoteSender:
    """Sends single requests of served models from this process's ``client``."""

    def __init__(self, client: Client):
        self.client = client
        self.stream = open_stream(client)
        self.token = uuid.uuid4().hex[:12]
        self.counter = itertools.count()

    def submit(self, model: str, payload: bytes, size: int = 1) -> ServedFuture:
        """One request of ``size`` samples whose input is ``payload``, and its future."""
        key = f"remote-{model}-{self.token}-{next(self.counter)}"
        future = self.stream.pending[key] = ServedFuture(key, self.client)
        self.stream.send_requests(model, [key], [payload], [size], sent_at=time.time())
        return future

    def close(self) -> None:
        self.client.sync(self.stream.close)

    def __enter__(self) -> RemoteSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def mark_in_hand(ended_at: dict[int, float] | list[float], index: int, future: Any) -> None:
    """A done callback (Dask runs it in its callback thread): the moment ``future``'s output is in
    this process, fetched if it did not ride the completion; an error is never in hand."""
    if future.status != "finished":
        return
    try:
        future.result()
    except Exception:  # released or lost before the fetch: not in hand
        return
    ended_at[index] = time.perf_counter()

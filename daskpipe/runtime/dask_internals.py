"""The places where daskpipe reaches past Dask's public hooks, each because no hook does the job.

Written against distributed 2026.7. Everything else extends Dask through what it offers: a
scheduler plugin with its handlers, worker handlers added to ``Worker.handlers`` and
``stream_handlers``, preloads, comms opened with ``distributed.comm.connect``, ``FutureState``
subclassed. What is here changes Dask's own behaviour or state, so a new release of distributed
may need it reviewed, and nothing outside this module does so:

* :func:`wrap_worker_handlers` puts a step before Dask's own worker handlers. A last stage keeps
  outputs its clients already hold out of Dask's worker state for a moment (``KEEP_S``,
  :mod:`daskpipe.runtime.worker.stage`); every Dask handler that reads or frees a worker's data
  must see them as stored, and Dask has no hook on its data access.
* :func:`gate_state_changes` wraps ``FutureState``'s state changes in a subclass: a future whose
  output came with its completion must stay finished when Dask loses its key, and the gate a
  synchronous ``result()`` waits on must follow every change. ``FutureState`` has no callback.
* :func:`put_in_memory` and :func:`report_in_memory` write a request's key into the scheduler's
  task state as ``Scheduler.update_data`` (the scatter path) does, and send Dask's own
  ``key-in-memory`` report: the outputs were stored by a daskpipe stage, not by a Dask task, and
  ``update_data`` would also tell every client at once, a message per key that daskpipe's own
  resolution makes redundant.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from distributed.comm import CommClosedError


def wrap_worker_handlers(
    worker: Any, handlers: Iterable[str], stream_handlers: Iterable[str], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace each of ``worker``'s named rpc ``handlers`` and ``stream_handlers`` with ``wrap`` of it."""
    for name in handlers:
        worker.handlers[name] = wrap(worker.handlers[name])
    for name in stream_handlers:
        worker.stream_handlers[name] = wrap(worker.stream_handlers[name])


STATE_CHANGES = ("cancel", "finish", "lose", "retry", "set_error", "reset")
"""Every way Dask's client moves a future's state (``FutureState``'s methods)."""


def gate_state_changes(cls: type, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Give ``cls``, a subclass of ``FutureState``, ``wrap`` of each of its base's state changes."""
    base = cls.__mro__[1]
    for name in STATE_CHANGES:
        if hasattr(base, name):
            setattr(cls, name, wrap(getattr(base, name)))


def put_in_memory(scheduler: Any, ts: Any, worker: str, nbytes: int) -> None:
    """Task ``ts`` (``released``, with no run spec) is in memory on ``worker``, ``nbytes`` large."""
    ts.state = "memory"
    ts.set_nbytes(nbytes)
    scheduler.add_replica(ts, scheduler.workers[worker])


def report_in_memory(scheduler: Any, client: str, ts: Any) -> None:
    """Dask's ``key-in-memory`` for ``ts`` to ``client``, as ``Scheduler.report`` sends it."""
    comm = scheduler.client_comms.get(client)
    if comm is None:
        return
    try:
        comm.send({"op": "key-in-memory", "key": ts.key, "workers": [ws.address for ws in ts.who_has or ()]})
    except CommClosedError:  # the client is leaving
        pass


def wrapped(handler: Callable[..., Any], before: Callable[[], Any]) -> Callable[..., Any]:
    """``handler`` with ``before()`` called first, keeping its signature (Dask reads it: a first ``comm``)."""

    @functools.wraps(handler)
    def handle(*args: Any, **kwargs: Any) -> Any:
        before()
        return handler(*args, **kwargs)

    return handle

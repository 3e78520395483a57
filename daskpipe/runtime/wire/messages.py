"""The wire vocabulary of daskpipe's runtime: message ops, handler names and worker resources.

Every message is a plain dict (msgpack), so the scheduler never unpickles user data. A request's
input stays with the client that submitted it, and the worker that runs its batch's first stage
fetches it from that client when the batch is dispatched: the scheduler sees only its byte count.
An input of at most ``daskpipe.inline-input-bytes`` rides the submission instead, as raw bytes
(msgpack ``bin``), which the scheduler keeps and forwards as they are. Feature maps and exceptions
ride as ``to_serialize`` payloads. Times on the wire are wall-clock seconds
(``time.time()``), the one clock that processes on different nodes share; the scheduler converts
them to its monotonic clock.

Paths of one request, each over one of daskpipe's immediate streams (:mod:`daskpipe.runtime.wire.streams`)::

    client   --SUBMIT-->              scheduler   (keys, sizes, sent_at; each input's byte count, or a small input)
    scheduler --REACH-->              client      (open a stream to these first-stage workers)
    scheduler --BATCH-->              worker of partition 0 (which inputs to fetch from which client)
    worker   --FETCH-->               client      (on the client's stream to that worker)
    client   --INPUTS-->              worker      (the raw inputs, as frames of their own)
    worker   --UNFETCHED-->           scheduler   (requests whose input could not be fetched, and why)
    scheduler --CLIENT_GONE-->        worker      (a client left: its inputs still to be fetched never will be)
    worker   --BATCH-->               worker of the next partition (fp16 feature map)
    scheduler --FORWARD-->            worker holding parked data (a staged data plane's next stage):
    worker   --BATCH-->               worker of that stage, which gathers the parts
    worker   --FEEDBACK-->            scheduler   (compute and transfer timings)
    worker   --DONE / FAILED-->       scheduler   (outputs stored under the keys, small ones inline / the cause)
    worker   --RESOLVED-->            client      (small outputs, on the client's REPLY stream to that worker)
    scheduler --RESOLVED-->           client      (the futures the worker did not tell; small outputs ride along)

A client opens a stream to a worker (the REPLY handler) when the scheduler asks it to (REACH: the
workers of the first stages its inputs go to) or resolves futures computed there (RESOLVED names
the worker). Over it the worker fetches the client's inputs and finishes the client's futures
itself: the scheduler is off the way in and the way back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, TypedDict

import msgspec

# client -> scheduler, over the client's batched stream
SUBMIT = "daskpipe-submit"
# scheduler -> worker, over the worker's batched stream
BATCH = "daskpipe-batch"
FORWARD = "daskpipe-forward"  # send parked intermediate data on to a staged batch's first stage
DISCARD = "daskpipe-discard"  # drop parked intermediate data (its request ended)
CLIENT_GONE = "daskpipe-client-gone"  # a client left: the inputs still to be fetched from it never will be
# worker -> scheduler, over the worker's batched stream
FEEDBACK = "daskpipe-feedback"
DONE = "daskpipe-done"
FAILED = "daskpipe-failed"
EXPIRED = "daskpipe-expired"  # a stage skipped a batch past its requests' late limit
UNFETCHED = "daskpipe-unfetched"  # a first stage could not fetch some requests' inputs from their client
# scheduler -> client, over the client's daskpipe stream: futures that finished, requests refused on arrival;
# worker -> client, over the client's REPLY stream to it: futures whose small outputs it computed
RESOLVED = "daskpipe-resolved"
REFUSED = "daskpipe-refused"
REACH = "daskpipe-reach"  # scheduler -> client: open streams to these workers (they will fetch its inputs)
# worker -> client and back, over the client's stream to the worker: a first stage fetching its batch's inputs
FETCH = "daskpipe-fetch"
INPUTS = "daskpipe-inputs"
# worker -> worker: the feature map (op BATCH), and HELLO that opens the stream at deploy
HELLO = "daskpipe-hello"
# scheduler -> worker, worker -> scheduler: PING and PONG measure the control path at deploy
PING = "daskpipe-ping"
PONG = "daskpipe-pong"
# scheduler -> worker, worker -> scheduler: a suspect slot's probe (daskpipe/runtime/scheduler/gray.py)
PROBE = "daskpipe-probe"
PROBED = "daskpipe-probed"
# client -> scheduler rpc handlers; STREAM turns the comm into a daskpipe stream (``client=`` or ``worker=``)
STREAM = "daskpipe_stream"
# client -> worker rpc handler: turns the comm into the worker's stream of RESOLVED to that client
REPLY = "daskpipe_reply"
INVENTORY = "daskpipe_inventory"
SERVE = "daskpipe_serve"
SERVE_POOL = "daskpipe_serve_pool"
CLOSE = "daskpipe_close"
STATUS = "daskpipe_status"
ELASTIC = "daskpipe_elastic"  # deploy hands over what re-planning needs (daskpipe/runtime/scheduler/elastic/controller.py)
PLAN = "daskpipe_plan"  # the plan in force
SCALING = "daskpipe_scaling"  # what Adaptive should add and remove (daskpipe/runtime/adaptive.py)
# a service's model set changing while it serves (daskpipe/runtime/scheduler/lifecycle.py)
ADD_MODEL = "daskpipe_add_model"
REMOVE_MODEL = "daskpipe_remove_model"
UPDATE_MODEL = "daskpipe_update_model"
RETIRE_MODEL = "daskpipe_retire_model"  # an updated model's old version, once the service sends to the new one
JOIN_POOL = "daskpipe_join_pool"  # a model added to a shared pool (daskpipe/runtime/client/pools.py)
LEAVE_POOL = "daskpipe_leave_pool"  # a model removed from a shared pool, once its requests have ended
GROW_POOL = "daskpipe_grow_pool"  # workers added to a shared pool: every model of it gets a stage on each


# -- the messages' shapes -----------------------------------------------------------------------
# Each stream message is a dict whose ``op`` names its kind (above); these say what else it holds.
# They cost nothing on the way (a TypedDict is a dict), and mypy checks every place that builds one.
# The one message that comes from outside the cluster's trust, a client's submission, is also
# checked on arrival, with msgspec (:func:`read_submission`).
Key = Any
"""A request's Dask key (a string, or a tuple of strings and numbers)."""


class Hop(TypedDict, total=False):
    """One stage of a batch's route: where it runs, its actor, its partition, the emulated hold;
    ``park``: the last stage of a staged batch keeps its output for the next dispatch."""

    address: str
    stage: str
    partition: int
    hold_s: float
    park: bool


class BatchHeader(TypedDict, total=False):
    """What every hop of a batch carries (BATCH, scheduler -> first stage and stage -> stage; FORWARD)."""

    op: str
    model: str
    dispatch: int
    keys: list[Key]
    sizes: list[int]
    route: list[Hop]
    expires: float  # the requests' late limit, wall clock
    clients: dict[str, list[int]]  # client id -> the indices of its keys: who the last stage tells
    inputs: list[Any]  # first stage: each request's raw input, or None where ``fetch`` names its client
    fetch: dict[str, list[int]]  # first stage: client id -> the indices of the inputs to fetch from it
    data: Any  # a later stage: the feature map (a packed tensor or a Dask frame)
    sent_at: float  # a later stage: when the previous one sent it, wall clock
    part: list[Key]  # a later stage gathering a staged batch: the keys of this part
    take: list[Key]  # FORWARD: the keys whose parked data the worker sends on


class Timings(TypedDict):
    """A stage's report of a batch (FEEDBACK): ``[partition, "compute" | "transfer", start, end]`` rows."""

    op: str
    model: str
    dispatch: int
    timings: list[list[Any]]
    overrun: bool


class Done(Timings, total=False):
    """A last stage's report (DONE): its outputs are out; ``outputs`` (packed) for the clients it did
    not tell (``told``); ``written_s``: from the outputs being ready to this message's write."""

    keys: list[Key]
    nbytes: list[int]
    told: list[str]
    outputs: list[Any]
    written_s: float


class Ended(TypedDict, total=False):
    """Requests of a batch that ended at a stage: FAILED (``exception``), EXPIRED, UNFETCHED (``reason``, ``detail``)."""

    op: str
    model: str
    dispatch: int
    keys: list[Key]
    exception: Any
    reason: str
    detail: str


class Resolved(TypedDict, total=False):
    """Futures that finished (RESOLVED, to a client): their outputs when they came along; ``worker``:
    the last stage's, which the client opens a stream to."""

    op: str
    keys: list[Key]
    outputs: list[Any]
    worker: str


class Fetch(TypedDict):
    """A first stage asking a client for inputs it holds (FETCH)."""

    op: str
    model: str
    dispatch: int
    keys: list[Key]


class Inputs(Fetch):
    """A client's answer to a FETCH (INPUTS): each input's raw bytes, ``None`` where it holds none."""

    client: str
    inputs: list[Any]


class Submission(msgspec.Struct, forbid_unknown_fields=True):
    """A client's SUBMIT: requests of ``model``, each a key, its raw input (bytes, a frame, or the
    byte count of an input the client holds) and its samples; ``start_block`` > 0 enters mid-model
    (hybrid); ``sent_at``: the client's wall clock when the caller handed them over."""

    model: str
    keys: list[Any]
    inputs: list[Any]
    sizes: list[Any]  # each checked with its request (``Ledger.refusal``): one bad size refuses one request
    start_block: int = 0
    sent_at: float | None = None


class MalformedSubmission(ValueError):
    """A SUBMIT message that is wrong as a whole: every one of its requests is refused with this."""


def read_submission(fields: Mapping[str, Any]) -> Submission:
    """``fields`` (a SUBMIT message less its ``op``) as a :class:`Submission`, or
    :class:`MalformedSubmission` saying what is wrong (msgspec's words: the field and what it got)."""
    try:
        submission = msgspec.convert(dict(fields), Submission, strict=True)
    except msgspec.ValidationError as exc:
        raise MalformedSubmission(str(exc)) from None
    if submission.start_block < 0:
        raise MalformedSubmission(f"start_block must be an integer >= 0, got {submission.start_block!r}")
    if submission.sent_at is not None and not math.isfinite(submission.sent_at):
        raise MalformedSubmission(f"sent_at must be a finite wall-clock time in seconds, got {submission.sent_at!r}")
    for name, values in (("inputs", submission.inputs), ("sizes", submission.sizes)):
        if len(values) != len(submission.keys):
            raise MalformedSubmission(f"{len(submission.keys)} keys and {len(values)} {name}")
    return submission


class ServeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a deployment's models are served, made once by ``deploy`` and carried to the scheduler
    (:meth:`to_wire`, :meth:`from_wire`), which keeps them for its re-plans: the data plane
    (``dispatcher``, by name), the time dilation ``k`` of every latency and SLO, the network's
    bandwidth the dispatcher times transfers at, and the bound on a model's queued requests
    (``None``: two SLOs' worth at its plan's capacity)."""

    dispatcher: str = "ppipe"
    time_dilation: float = 1.0
    bw_gbps: float = 10.0
    max_queued: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> ServeSettings:
        """The settings :meth:`to_wire` sent; ``ValueError`` naming the field that is wrong."""
        try:
            settings = msgspec.convert(dict(fields), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"serve settings: {exc}") from None
        if not (settings.time_dilation > 0 and math.isfinite(settings.time_dilation)):
            raise ValueError(f"time_dilation must be > 0, got {settings.time_dilation!r}")
        return settings


# Worker resources, the contract with ``daskpipe worker`` (daskpipe/runtime/worker/slots.py)
SLOT_RESOURCE = "daskpipe.slot"
GPU_RESOURCE_PREFIX = "daskpipe.gpu."
SLICES_RESOURCE_PREFIX = "daskpipe.slices."
EMULATED_RESOURCE = "daskpipe.emulated"
CPU = "cpu"
GPU_DEVICE = "gpu"
"""A stage's ``device`` for "this worker's GPU": the worker's backend says which torch device that
is (``cuda``, or the host for a fake GPU; daskpipe/runtime/worker/gpu.py)."""


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker offers the planner: one (virtual) GPU, or a CPU slot on a plain Dask worker."""

    address: str
    gpu: str
    slices: int
    server: str
    emulated: bool

    def to_msg(self) -> dict:
        return {"address": self.address, "gpu": self.gpu, "slices": self.slices, "server": self.server, "emulated": self.emulated}

    @classmethod
    def from_msg(cls, msg: Mapping) -> WorkerSlot:
        return cls(str(msg["address"]), str(msg["gpu"]), int(msg["slices"]), str(msg["server"]), bool(msg["emulated"]))


def worker_slot(address: str, name: object, resources: Mapping[str, float], host: str) -> WorkerSlot | None:
    """The slot a worker advertises; ``None`` for a daskpipe worker whose resources are incomplete.

    A plain Dask worker (no ``daskpipe.slot``) is a CPU slot on its host. A daskpipe worker is named
    ``"<server>/<TYPE>-<gpu index>/<slice index>"``; slots of one server share its NIC.
    """
    if SLOT_RESOURCE not in resources:
        return WorkerSlot(address, CPU, 1, host, emulated=False)
    gpus = [r[len(GPU_RESOURCE_PREFIX) :] for r in resources if r.startswith(GPU_RESOURCE_PREFIX)]
    slices = [r[len(SLICES_RESOURCE_PREFIX) :] for r in resources if r.startswith(SLICES_RESOURCE_PREFIX)]
    if len(gpus) != 1 or len(slices) != 1 or not slices[0].isdigit():
        return None
    server = str(name).split("/")[0] if isinstance(name, str) and "/" in name else host
    return WorkerSlot(address, gpus[0], int(slices[0]), server, emulated=EMULATED_RESOURCE in resources)

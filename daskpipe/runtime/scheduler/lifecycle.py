"""Models added to, removed from and updated in a running deployment, on the scheduler.

:meth:`Service.add_model <daskpipe.runtime.client.service.Service.add_model>`, ``remove_model`` and
``update_model`` call these handlers. Each change is a change of the model set of the service's
deployment (:class:`~daskpipe.runtime.scheduler.elastic.state.Deployment`) followed by the elastic
controller's own re-plan (:meth:`~daskpipe.runtime.scheduler.elastic.controller.Elastic.plan_for`, then
:meth:`~daskpipe.runtime.scheduler.elastic.controller.Elastic.migrate`): the MILP plans the new set on the
deployment's slots, the new stages start while the old ones serve, then the models switch at once
as on a worker joining (their queued requests wait through the flush). One change at a time: the
controller's lock also holds off its own re-plans meanwhile.

* **add**: the new model starts serving on its new stages (its control path measured as
  ``deploy`` does), then the others switch to the new plan.
* **remove**: the service stops admitting the model first; here the requests it sent are awaited,
  served to their end (queued ones dispatched, batches in flight finished), then the model is
  closed, its stages released, and the others re-planned onto the freed slots.
* **update**: the new version is planned in place of the old under a name of its own
  (``name@v2``), and served on its own stages; the old version is *retiring*: it keeps its stages
  and its requests, and is not switched. Once the service sends new requests to the new version,
  :meth:`Lifecycle.retire` ends the old one as ``remove`` does, without a re-plan (the plan in
  force already gave its slots to the others).

Nothing is lost: a request the drain could not end in time ends as "shutdown", its detail
saying the model was removed; a batch still in flight after the flush fails, saying why.
Torch-free: the scheduler imports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from daskpipe.runtime.errors import DeployError, RequestFailed
from daskpipe.runtime.scheduler.elastic.state import Deployment, ModelSpec, NewModel
from daskpipe.runtime.scheduler.ledger import Failed
from daskpipe.runtime.scheduler.models import Models
from daskpipe.runtime.wire import messages
from daskpipe.sched.registry import remove_shared_model
from daskpipe.sched.symphony import DeferredDispatcher, SharedPoolRoute

if TYPE_CHECKING:
    from daskpipe.plan.schema import Plan
    from daskpipe.runtime.scheduler.elastic.controller import Elastic

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.005
"""How often a drain looks whether the model's last request has ended."""


class Lifecycle:
    """The scheduler's handlers for a service's model-set changes (see the module docstring)."""

    def __init__(self, models: Models, elastic: Elastic):
        self.models = models
        self.elastic = elastic

    def handlers(self) -> dict[str, Any]:
        return {
            messages.ADD_MODEL: self.add,
            messages.REMOVE_MODEL: self.remove,
            messages.UPDATE_MODEL: self.update,
            messages.RETIRE_MODEL: self.retire,
            messages.LEAVE_POOL: self.leave_pool,
        }

    # -- rpc handlers ----------------------------------------------------------------------------
    async def add(
        self,
        models: Sequence[str],
        model: str,
        spec: dict,
        slo_us: float | None = None,
        weight: float = 1.0,
        max_queued: int | None = None,
        sample_nbytes: int = 0,
    ) -> dict:
        """Serve ``model`` (``spec``: :meth:`ModelSpec.from_msg`'s) beside ``models``, re-planning
        their deployment for it; the new plan, or :class:`DeployError` with the plan in force kept."""
        self._check_new(model)
        async with self.elastic.lock:
            group, dep = self._deployment(models)
            self._check_new(model)
            dep.models[model], dep.weights[model] = ModelSpec.from_msg(model, spec), float(weight)
            if slo_us is not None:
                dep.slo_us[model] = float(slo_us)
            try:
                plan = await self._replan(group, dep, f"model {model!r} added", model, NewModel(max_queued, sample_nbytes))
            except Exception:
                del dep.models[model], dep.weights[model]
                dep.slo_us.pop(model, None)
                raise
        return plan.to_dict()

    async def remove(self, models: Sequence[str], model: str, sent: int, timeout_s: float) -> dict:
        """End ``model`` once the ``sent`` requests its service sent it have ended (at most
        ``timeout_s``), release its stages, and re-plan the rest of its deployment onto them;
        returns the plan in force then."""
        async with self.elastic.lock:
            group, dep = self._deployment(models)
            if model not in dep.models:
                raise DeployError(f"model {model!r} is not served by this service; it serves {sorted(dep.models)}")
            if len(dep.models) == 1:
                raise DeployError(f"model {model!r} is the service's last model; close the service instead")
            await self._drain(model, sent, timeout_s)
            rows = dep.rows.pop(model, [])
            del dep.models[model]
            dep.weights.pop(model, None)
            dep.slo_us.pop(model, None)
            dep.plan = replace(dep.plan, models=tuple(m for m in dep.plan.models if m.name != model))
            self.elastic.retire(row[3] for row in rows)
            try:
                await self._replan(group, dep, f"model {model!r} removed")
            except DeployError as exc:  # the others keep their plan: the model is gone all the same
                logger.warning("daskpipe: after %s was removed, re-planning the rest failed (%s); their plan stays", model, exc)
        return dep.plan.to_dict()

    async def update(
        self,
        models: Sequence[str],
        model: str,
        version: str,
        spec: dict,
        slo_us: float | None = None,
        max_queued: int | None = None,
        sample_nbytes: int = 0,
    ) -> dict:
        """Plan and serve ``version`` (a new version of ``model``, ``spec`` its blocks and profile)
        in ``model``'s place; ``model`` keeps serving what it holds until :meth:`retire`."""
        self._check_new(version)
        async with self.elastic.lock:
            group, dep = self._deployment(models)
            if model not in dep.models:
                raise DeployError(f"model {model!r} is not served by this service; it serves {sorted(dep.models)}")
            self._check_new(version)
            old, weight, old_slo, rows = dep.models.pop(model), dep.weights.pop(model), dep.slo_us.pop(model, None), dep.rows.pop(model)
            dep.retiring[model] = rows
            dep.models[version], dep.weights[version] = ModelSpec.from_msg(version, spec), weight
            if slo_us is not None or old_slo is not None:
                dep.slo_us[version] = float(slo_us if slo_us is not None else old_slo)  # type: ignore[arg-type]
            try:
                plan = await self._replan(
                    group,
                    dep,
                    f"model {model!r} updated to {version!r}",
                    version,
                    NewModel(max_queued, sample_nbytes),
                )
            except Exception:
                del dep.models[version], dep.weights[version], dep.retiring[model]
                dep.slo_us.pop(version, None)
                dep.models[model], dep.weights[model], dep.rows[model] = old, weight, rows
                if old_slo is not None:
                    dep.slo_us[model] = old_slo
                raise
        return plan.to_dict()

    async def retire(self, model: str, sent: int, timeout_s: float) -> str:
        """End ``model``, an updated model's old version, once the ``sent`` requests its service
        sent it have ended (at most ``timeout_s``), and release its stages."""
        async with self.elastic.lock:
            dep = next((d for d in self.elastic.deployments.values() if model in d.retiring), None)
            if dep is None:
                raise DeployError(f"model {model!r} is not an old version being retired")
            await self._drain(model, sent, timeout_s)
            self.elastic.retire(row[3] for row in dep.retiring.pop(model))
        return "OK"

    async def leave_pool(self, model: str, sent: int, timeout_s: float) -> str:
        """End ``model``, a shared pool's model, as :meth:`remove` ends one (its ``sent`` requests
        first, at most ``timeout_s``), and take it out of the pool's dispatcher; the pool's other
        models keep its slots, with no re-plan (a pool's last model leaves them idle). Its
        service releases its stages."""
        async with self.elastic.lock:
            ledger = self.models.ledgers.get(model)
            if ledger is None or ledger.closing:
                raise DeployError(f"model {model!r} is not served here")
            shared = ledger.dispatcher
            if not (isinstance(shared, DeferredDispatcher) and isinstance(shared.route, SharedPoolRoute)):
                raise DeployError(f"model {model!r} is not served by a shared pool; its service removes it with a re-plan")
            staying = any(m != model and other.dispatcher is shared and not other.closing for m, other in self.models.ledgers.items())
            await self._drain(model, sent, timeout_s)
            if staying:  # nothing of it is queued there: the drain closed it
                remove_shared_model(shared, model, time.monotonic())
        return "OK"

    # -- steps -----------------------------------------------------------------------------------
    def _check_new(self, model: str) -> None:
        if model in self.models.ledgers:
            raise DeployError(f"model {model!r} is already served; remove it first, or give the new model another name")

    def _deployment(self, models: Sequence[str]) -> tuple[str, Deployment]:
        for group, dep in self.elastic.deployments.items():
            if set(models) <= set(dep.models):
                return group, dep
        raise DeployError(
            f"models {sorted(models)} have no elastic deployment here: a service deployed with elastic=None keeps its plan; deploy "
            f"with elastic=ElasticSettings() to add, remove or update models"
        )

    async def _replan(self, group: str, dep: Deployment, reason: str, new: str | None = None, serve: NewModel = NewModel()) -> Plan:
        """Plan ``dep``'s model set as it is now and migrate to it, ``new`` starting to serve; a
        model the plan gives no pipeline fails it, naming the model."""
        started = time.perf_counter()
        slots = self.elastic.inventory_of(dep)
        if not slots:
            raise DeployError(f"no slot is left to plan {sorted(dep.models)} on")
        try:
            plan = await self.elastic.plan_for(dep, slots)
        except Exception as exc:
            raise DeployError(f"the cluster cannot serve {sorted(dep.models)} together: {exc}") from exc
        unserved = [m for m in dep.models if not plan.model(m).pipelines]
        if unserved:
            raise DeployError(
                f"the cluster's {len(slots)} slots cannot fit {unserved} beside the other models: the plan gives them no pipeline; "
                f"add GPUs, or remove a model first"
            )
        if new is None and plan.models == dep.plan.models and dep.addresses() <= {s.address for s in slots}:
            return dep.plan  # nothing to migrate
        await self.elastic.migrate(group, plan, slots, [reason], started, serve={new: serve} if new is not None else None)
        return plan

    async def _drain(self, model: str, sent: int, timeout_s: float) -> None:
        """Wait for ``model`` to take the ``sent`` requests sent to it and end them all; then close
        and forget it. What is left at ``timeout_s`` ends: queued requests dropped ("shutdown"),
        batches still running after the flush failed, each saying why."""
        models = self.models
        ledger = models.ledgers.get(model)
        if ledger is None:
            return
        deadline = time.monotonic() + timeout_s
        while (ledger.counts["submitted"] < sent or ledger.queued or ledger.flights) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        models.close([model], reason="shutdown")
        flush_until = time.monotonic() + self.elastic.settings.flush_timeout_s
        while ledger.flights and time.monotonic() < flush_until:
            await asyncio.sleep(DRAIN_POLL_S)
        if ledger.flights:
            keys = [key for flight in ledger.flights.values() for key in flight.keys]
            failure = RequestFailed(f"model {model!r} was removed while its batch ran, and the batch did not end within the flush")
            ledger.end(keys, Failed(failure))
            ledger.flights.clear()
        models.status([model], forget=True)
        logger.info("daskpipe: %s ended: its requests ended, its stages are released", model)

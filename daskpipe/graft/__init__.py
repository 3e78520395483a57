"""Hybrid edge/cloud inference: fragments that enter a model mid-way, and Graft's re-alignment.

``fragments`` models devices and their Neurosurgeon splits, ``costs`` sizes a stage on MPS shares,
``planner`` is Graft's scheduler (merge, group, re-align), ``baselines`` gives per-fragment
serving and the exhaustive optimum, ``simulate`` checks a plan's SLO attainment (a data plane:
imported from its module, not from this package, which the runtime loads) and ``execute`` the
in-process reference data plane (``daskpipe bench graft`` is ``daskpipe.benchmarks.graft``). The data plane
of hybrid plans, a scheduling policy like the others, is ``daskpipe.sched.hybrid`` (the
``"hybrid"`` data plane of ``daskpipe.sched.registry``; served by ``daskpipe.runtime.client.hybrid``).
See docs/hybrid.md.
"""

from __future__ import annotations

from daskpipe.graft.baselines import optimum, per_fragment
from daskpipe.graft.costs import StageConfig, StageCosts
from daskpipe.graft.fragments import JETSON_NANO, JETSON_TX2, DeviceType, Fragment, Uplink, neurosurgeon_split, sample_fragments
from daskpipe.graft.planner import GraftPlan, GroupPlan, Level, PlanningError, ServingPlan, group, merge, plan_graft, realign

__all__ = [
    "DeviceType",
    "Fragment",
    "GraftPlan",
    "GroupPlan",
    "JETSON_NANO",
    "JETSON_TX2",
    "Level",
    "PlanningError",
    "ServingPlan",
    "StageConfig",
    "StageCosts",
    "Uplink",
    "group",
    "merge",
    "neurosurgeon_split",
    "optimum",
    "per_fragment",
    "plan_graft",
    "realign",
    "sample_fragments",
]

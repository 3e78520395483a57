from __future__ import annotations

import pytest

from daskpipe.colocation.defaults import INSS_RATES, INSS_SLO_MS, inss_gpus, inss_testbed
from daskpipe.colocation.latency import Colocated, ColocationError, GpuSpec
from daskpipe.colocation.policy import Gpu, Workload, make_policy
from daskpipe.colocation.profiles import model_from_profiles, to_plan
from daskpipe.plan.schema import Plan

# SM counts of the published profiles' GPUs (NVIDIA specifications); the GPU catalog will supply these.
SPECS = {
    "T4": GpuSpec("T4", sm_count=40, memory_mb=15360, pcie_gb_per_s=12.0),
    "V100": GpuSpec("V100", sm_count=80, memory_mb=16384, pcie_gb_per_s=12.0),
    "P4": GpuSpec("P4", sm_count=20, memory_mb=7680, pcie_gb_per_s=12.0),
}


@pytest.mark.shared
def test_model_from_published_profiles_fits_their_tables(ppipe_dir):
    from daskpipe.profiles.loader import load_profiles

    profiles = load_profiles(ppipe_dir, models=["googlenet", "repvgg"])
    model = model_from_profiles(profiles, SPECS)
    assert "googlenet-v3-pytorch@P4" in model.notes["skipped"]  # P4 has one slice count only
    profile = profiles["googlenet-v3-pytorch"]
    for v in profile.slices("T4"):
        measured = profile.latency("T4", v, 1) / 1000
        predicted = model.exec_ms("T4", Colocated(profile.model, 1 / v, 1))
        assert predicted == pytest.approx(measured, rel=0.25)
    plan = make_policy("inss", model, search_budget=200).place(
        [Workload(name, 20, p.slo_us / 1000) for name, p in profiles.items()], [Gpu("a", "T4"), Gpu("b", "V100")]
    )
    assert len(plan.replicas) == 2


def test_model_from_profiles_needs_two_slice_counts():
    import numpy as np

    from daskpipe.profiles.model import Profile

    single = Profile(model="m", slo_us=1e4, num_blocks=1, latency_us={("T4", 1): np.array([[1000.0, 1800.0]])}, boundary_bytes=())
    with pytest.raises(ColocationError, match=">= 2 slice counts"):
        model_from_profiles({"m": single}, SPECS)


def test_placement_becomes_a_valid_plan():
    model = inss_testbed()
    gpus = [Gpu(uid, kind) for uid, kind in inss_gpus()]
    workloads = [Workload(name, INSS_RATES[name], INSS_SLO_MS[name]) for name in INSS_SLO_MS]
    placement = make_policy("gpulet", model).place(workloads, gpus)
    plan = to_plan(placement, workloads, gpus, model)
    again = Plan.from_dict(plan.to_dict())
    assert again.strategy == "gpulet"
    assert len(again.models) == 8 and sum(len(m.pipelines) for m in again.models) == len(placement.replicas)
    assert again.settings["colocation"]["replicas"][0]["gpu"] in {g.uid for g in gpus}

from __future__ import annotations

import math

import pytest

from daskpipe.plan.milp import make_plan
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan, PlanError

from .helpers import synthetic_profile

PAIR = 1 / 1.2e-3  # B[0] -> A[1]: the B pool limits it to 833.3 req/s per pair
WHOLE_A, WHOLE_B = 1 / 2e-3, 1 / 11.2e-3


def cbc(**fields) -> PlannerOptions:
    """Planner options solving with CBC, which every install has."""
    return PlannerOptions(solver="cbc", **fields)


def test_np_runs_whole_models(two_block):
    plan = make_plan({"m": two_block}, {"A": 1, "B": 1}, options=cbc(strategy="np"))
    assert plan.objective == pytest.approx(WHOLE_A + WHOLE_B)
    assert all(len(p.partitions) == 1 for p in plan.model("m").pipelines)


def test_ppipe_pipelines_the_slow_gpu(two_block):
    plan = make_plan({"m": two_block}, {"A": 1, "B": 1}, options=cbc())
    assert plan.objective == pytest.approx(PAIR)
    (pipeline,) = plan.model("m").pipelines
    assert [(p.blocks, p.gpu, p.vgpus) for p in pipeline.partitions] == [((0, 1), "B", 1), ((1, 2), "A", 1)]
    assert plan.solver["name"] == "CBC" and plan.solver["status"] == "optimal"
    assert plan.cluster["gpus"] == {"A": 1, "B": 1}


def test_plan_round_trips_through_json(tmp_path, two_block):
    plan = make_plan({"m": two_block}, {"A": 2, "B": 3}, options=cbc())
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == Plan.from_dict(plan.to_dict())


def test_dart_r_replicates_the_pair_plan(two_block):
    # NP gives the model all 5 GPUs; 2 (A, B) pairs run B -> A, the third B runs the whole model
    plan = make_plan({"m": two_block}, {"A": 2, "B": 3}, options=cbc(strategy="dart-r"))
    assert plan.objective == pytest.approx(2 * PAIR + WHOLE_B)
    assert plan.gpus_used() == {"A": 2, "B": 3}


def test_ppipe_beats_baselines_on_a_mixed_cluster(two_block):
    cluster = {"A": 2, "B": 6}
    objectives = {s: make_plan({"m": two_block}, cluster, options=cbc(strategy=s)).objective for s in ("ppipe", "np", "dart-r")}
    assert objectives["ppipe"] >= objectives["dart-r"] >= objectives["np"] > 0


def test_max_min_over_weighted_models(two_block):
    other = synthetic_profile("other", {("A", 1): [1000, 1000], ("B", 1): [1200, 10000]})
    plan = make_plan({"m": two_block, "other": other}, {"A": 4}, weights={"m": 1, "other": 3}, options=cbc(strategy="np"))
    # 500 req/s per A: one GPU for m, three for other
    assert plan.objective == pytest.approx(WHOLE_A)
    assert plan.model("other").throughput == pytest.approx(3 * WHOLE_A)


def test_slices_of_one_gpu_serve_one_model():
    half = {("A", 1): [1000], ("A", 2): [1100]}  # a half-GPU is nearly as fast: slicing pays
    profiles = {m: synthetic_profile(m, half) for m in ("m1", "m2", "m3")}
    plan = make_plan(profiles, {"A": 4}, options=cbc())
    physical = 0
    for model in plan.models:
        per_slices: dict[int, int] = {}
        for pipeline in model.pipelines:
            for part in pipeline.partitions:
                per_slices[part.slices] = per_slices.get(part.slices, 0) + part.vgpus
        physical += sum(math.ceil(n / v) for v, n in per_slices.items())
    assert physical <= 4
    # 4 GPUs for 3 models: two get one GPU as two slices (1818 req/s), the bound is one GPU each
    assert plan.objective == pytest.approx(2 / 1.1e-3)


def test_one_pipeline_per_route_is_optional():
    p = synthetic_profile("m", {("A", 1): [1000, 1000], ("B", 1): [1000, 3000]})
    free = make_plan({"m": p}, {"A": 3, "B": 4}, options=cbc(one_pipeline_per_route=False))
    strict = make_plan({"m": p}, {"A": 3, "B": 4}, options=cbc())
    assert free.objective >= strict.objective
    routes = [tuple(q.gpu for q in pl.partitions) for pl in strict.model("m").pipelines]
    assert len(routes) == len(set(routes))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpus={}), "no GPUs"),
        (dict(gpus={"A": 0}), "positive integer"),
        (dict(gpus={"A": 1, "C": 2}), r"no profile for GPU type\(s\) \['C'\] \(it has \['A', 'B'\]\)"),
        (dict(weights={"x": 1}), "one weight per model"),
        (dict(weights={"m": -1}), "weight of 'm' must be a positive number"),
        (dict(slo_us={"x": 5}), "slo_us names model 'x'"),
        (dict(gpus_per_server={"C": 1}), "gpus_per_server names GPU type 'C'"),
        (dict(gpus={"A": 1, "B": 1, "C": 1}, options=cbc(allow_missing_gpus=True, strategy="dart-r")), "two types"),
        (dict(options={"solver": "cbc"}), "options must be a PlannerOptions, got dict"),
    ],
)
def test_bad_inputs_name_the_problem(two_block, kwargs, message):
    args = dict(gpus={"A": 1, "B": 1}, options=cbc())
    args.update(kwargs)
    with pytest.raises(PlanError, match=message):
        make_plan({"m": two_block}, args.pop("gpus"), **args)


def test_slo_below_fastest_latency_says_what_would_fit(two_block):
    with pytest.raises(
        PlanError, match=r"fastest pipeline takes 2000 µs \(whole model on A at batch 1\); raise its SLO to at least 3333 µs"
    ):
        make_plan({"m": two_block}, {"A": 1, "B": 1}, slo_us={"m": 3000}, options=cbc())


def test_missing_gpu_types_can_be_skipped_on_request(two_block):
    plan = make_plan({"m": two_block}, {"A": 1, "C": 5}, options=cbc(allow_missing_gpus=True))
    assert plan.objective == pytest.approx(WHOLE_A)


def test_highs_when_asked_and_available(two_block):
    pytest.importorskip("highspy")
    plan = make_plan({"m": two_block}, {"A": 1, "B": 1}, options=PlannerOptions(solver="highs"))
    assert plan.solver["name"] == "HiGHS" and plan.objective == pytest.approx(PAIR)


def broken(monkeypatch, *solvers: str) -> None:
    """python-mip as where the named solvers' libraries do not load (mip 2 without cbcbox: a NameError)."""
    import mip

    model = mip.Model

    def refusing(*args, solver_name: str = "", **kwargs):
        if solver_name.upper() in solvers:
            raise NameError("name 'cbclib' is not defined")
        return model(*args, solver_name=solver_name, **kwargs)

    monkeypatch.setattr(mip, "Model", refusing)


def test_auto_takes_highs_where_cbc_does_not_load(two_block, monkeypatch):
    pytest.importorskip("highspy")
    assert make_plan({"m": two_block}, {"A": 1, "B": 1}).solver["name"] == "CBC"
    broken(monkeypatch, "CBC")
    plan = make_plan({"m": two_block}, {"A": 1, "B": 1})
    assert plan.solver["name"] == "HiGHS" and plan.objective == pytest.approx(PAIR)


def test_no_usable_solver_is_a_plan_error_naming_both(two_block, monkeypatch):
    broken(monkeypatch, "CBC", "HIGHS")
    with pytest.raises(PlanError, match=r"no MILP solver is usable: CBC's library does not load, and HiGHS's neither \(NameError"):
        make_plan({"m": two_block}, {"A": 1, "B": 1})
    with pytest.raises(PlanError, match=r"solver 'highs' is not usable \(NameError: name 'cbclib' is not defined\)"):
        make_plan({"m": two_block}, {"A": 1, "B": 1}, options=PlannerOptions(solver="highs"))


def test_golden_fcn_on_v100_and_p4(ppipe_dir):
    """PPipe Fig. 11/12: FCN on 4 V100 + 12 P4 (V100-P4 [2,1] per server, 6 Gbit/s), SLO 33.3 ms."""
    from daskpipe.profiles.loader import load_profiles

    profiles = load_profiles(ppipe_dir, ["fcn"])
    (name,) = profiles
    plan = make_plan(profiles, {"V100": 4, "P4": 12}, gpus_per_server={"V100": 2, "P4": 1}, slo_us={name: 33300}, options=cbc(bw_gbps=6))
    assert plan.objective == pytest.approx(1212, abs=3)
    whole, pooled = sorted(plan.model(name).pipelines, key=lambda p: len(p.partitions))
    assert (whole.batch_size, whole.partitions[0].gpu, whole.partitions[0].vgpus) == (2, "V100", 1)
    assert whole.partitions[0].latency_us == pytest.approx(12303)
    assert whole.throughput == pytest.approx(162.6, abs=0.1)
    p4, v100 = pooled.partitions
    assert pooled.batch_size == 1
    assert (p4.blocks, p4.gpu, p4.vgpus, p4.latency_us) == ((0, 7), "P4", 12, 11086)
    assert (v100.blocks, v100.gpu, v100.slices, v100.vgpus, v100.latency_us) == ((7, 10), "V100", 2, 6, 5711)
    assert p4.transfer_us == pytest.approx(1398, abs=1)
    assert pooled.throughput == pytest.approx(1051, abs=1)  # 6 / 5.711 ms; the P4 pool could do 1082


THREE_PART_CASES = [
    # blocks on A, blocks on B (and B/2), inventory: A -> B -> A pipelines tempt the pruning
    ({("A", 1): [300, 1000, 300], ("B", 1): [400, 9000, 400], ("B", 2): [700, 16000, 700]}, {"A": 2, "B": 5}),
    ({("A", 1): [100, 1000, 100], ("B", 1): [1000, 100, 1000]}, {"A": 3, "B": 3}),
    ({("A", 1): [100, 1000, 100], ("B", 1): [1000, 100, 1000]}, {"A": 7, "B": 2}),
    ({("A", 1): [200, 200, 900, 100], ("B", 1): [250, 900, 300, 800]}, {"A": 4, "B": 6}),
    ({("A", 1): [500, 100, 500], ("B", 1): [600, 900, 200], ("C", 1): [100, 700, 900]}, {"A": 2, "B": 2, "C": 2}),
    ({("A", 1): [500, 100, 500], ("B", 1): [600, 900, 200], ("C", 1): [100, 700, 900]}, {"A": 5, "B": 1, "C": 3}),
]


@pytest.mark.parametrize("blocks, gpus", THREE_PART_CASES)
def test_three_parts_contain_every_two_part_plan(blocks, gpus):
    p = synthetic_profile("m", blocks)
    q = synthetic_profile("n", {key: list(reversed(lat)) for key, lat in blocks.items()})
    two = make_plan({"m": p, "n": q}, gpus, options=cbc(max_parts=2))
    three = make_plan({"m": p, "n": q}, gpus, options=cbc(max_parts=3))
    assert two.solver["status"] == three.solver["status"] == "optimal"
    assert three.objective >= two.objective - 1e-6
    assert three.bound >= two.bound - 1e-6
    assert three.settings["max_parts"] == 3


def test_a_plan_says_how_good_it_is(two_block):
    plan = make_plan({"m": two_block}, {"A": 2, "B": 3}, options=cbc())
    assert plan.bound >= plan.objective and plan.gap == pytest.approx((plan.bound - plan.objective) / plan.bound)
    assert plan.gap <= 0.005 and plan.solver["status"] == "optimal"
    again = Plan.from_dict(plan.to_dict())
    assert (again.bound, again.gap) == (plan.bound, plan.gap)
    assert "proven" in plan.quality() and "NOT" not in plan.quality()


def test_a_plan_without_a_bound_says_it_is_not_proven(two_block):
    plan = make_plan({"m": two_block}, {"A": 1, "B": 1}, options=cbc(strategy="dart-r"))
    assert plan.bound is None and plan.gap is None and "not proven" in plan.quality()
    assert "bound" not in plan.to_dict()


def test_golden_fcn_with_routes_shared(ppipe_dir):
    """Without PPipe's one-pipeline-per-route restriction two P4 -> V100/2 pipelines beat the paper's plan."""
    from daskpipe.profiles.loader import load_profiles

    profiles = load_profiles(ppipe_dir, ["fcn"])
    (name,) = profiles
    plan = make_plan(
        profiles,
        {"V100": 4, "P4": 12},
        gpus_per_server={"V100": 2, "P4": 1},
        slo_us={name: 33300},
        options=cbc(bw_gbps=6, one_pipeline_per_route=False),
    )
    assert plan.objective == pytest.approx(1218.9, abs=0.1)
    assert plan.gpus_used() == {"V100": 4, "P4": 12}


PAPER_GRID_OBJECTIVES = {  # docs/plan.md's table: G1-G4 on HC1-HC4, as first planned with CBC to optimality
    ("HC1", "G1"): 1717.2, ("HC1", "G2"): 4284.9, ("HC1", "G3"): 2482.3, ("HC1", "G4"): 3148.8,
    ("HC2", "G1"): 2106.9, ("HC2", "G2"): 3476.9, ("HC2", "G3"): 1812.3, ("HC2", "G4"): 2980.2,
    ("HC3", "G1"): 1743.9, ("HC3", "G2"): 2863.1, ("HC3", "G3"): 1847.1, ("HC3", "G4"): 2318.8,
    ("HC4", "G1"): 2106.7, ("HC4", "G2"): 3132.8, ("HC4", "G3"): 1805.7, ("HC4", "G4"): 2422.0,
}  # fmt: skip


@pytest.mark.slow
def test_the_paper_grid_keeps_its_objectives_within_the_gap(ppipe_dir):
    from daskpipe.plan.specs import group_cases

    for cluster, group, profiles, weights in group_cases(["HC1", "HC2", "HC3", "HC4"], ["G1", "G2", "G3", "G4"], ppipe_dir):
        options = cbc(bw_gbps=cluster.bw_gbps)
        plan = make_plan(profiles, cluster.gpus, weights=weights, gpus_per_server=cluster.gpus_per_server, options=options)
        assert plan.objective >= (1 - options.gap) * PAPER_GRID_OBJECTIVES[(cluster.name, group.name)], (cluster.name, group.name)
        assert plan.solver["status"] == "optimal" and plan.gap <= options.gap

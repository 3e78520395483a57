from __future__ import annotations

import pytest

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import PlanError


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(strategy="magic"), "unknown strategy 'magic'"),
        (dict(solver="gurobi"), "unknown solver 'gurobi'"),
        (dict(margin=1.0), r"margin must be in \[0, 1\)"),
        (dict(max_parts=0), "max_parts must be an integer >= 1"),
        (dict(max_parts=2.0), "max_parts must be an integer >= 1"),
        (dict(bw_gbps=0), "bw_gbps must be a positive number"),
        (dict(time_limit=float("inf")), "time_limit must be a positive number"),
        (dict(allow_missing_gpus="yes"), "allow_missing_gpus must be True or False"),
    ],
)
def test_a_bad_field_is_named(fields, message):
    with pytest.raises(PlanError, match=message):
        PlannerOptions(**fields)


def test_options_round_trip_through_a_dict():
    options = PlannerOptions(strategy="np", bw_gbps=6.0, margin=0.2, max_parts=3, solver="cbc", allow_missing_gpus=True)
    assert PlannerOptions.from_dict(options.to_dict()) == options
    assert PlannerOptions.from_dict({}) == PlannerOptions()


def test_from_dict_names_unknown_and_bad_fields():
    with pytest.raises(PlanError, match=r"unknown planner options \['slo_us'\]"):
        PlannerOptions.from_dict({"slo_us": {}})
    with pytest.raises(PlanError, match="margin must be in"):
        PlannerOptions.from_dict({"margin": -0.1})

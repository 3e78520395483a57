"""The experiment summary computes the paper's figures from raw runs."""

from __future__ import annotations

import pytest

from daskpipe.benchmarks.experiments import ppipe_experiment, summarize


def run(cluster, strategy, lfs, dataplane="ppipe", arrivals="poisson", util=0.5):
    return {
        "cluster": cluster,
        "group": "G1",
        "strategy": strategy,
        "dataplane": dataplane,
        "arrivals": arrivals,
        "max_load_factor": dict(zip("abc", lfs)),
        "low_class_utilization": util,
    }


def test_summary_figures():
    runs = [
        run("HC1", "ppipe", [1.0, 0.9, 0.8], util=0.7),
        run("HC1", "np", [0.6, 0.6, 0.6], util=0.1),
        run("HC1", "ppipe", [0.3, 0.3, 0.3], dataplane="reactive"),
        {"cluster": "HC2", "strategy": "np", "error": "infeasible"},
    ]
    s = summarize(runs)
    assert s["mean_max_load_factor"]["poisson"] == {"np": pytest.approx(0.6), "ppipe": pytest.approx(0.9)}
    assert s["gain_over"]["np"]["poisson"]["HC1"] == pytest.approx(0.5)
    assert s["low_class_utilization"] == {"np": 0.1, "ppipe": 0.7}
    assert s["ablation"]["HC1"] == {"reactive": pytest.approx(0.3), "ppipe": pytest.approx(0.9)}


def test_unknown_names_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown cluster"):
        ppipe_experiment(tmp_path, clusters=["HC9"])
    with pytest.raises(ValueError, match="must include 'ppipe'"):
        ppipe_experiment(tmp_path, strategies=["np"])

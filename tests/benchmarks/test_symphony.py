"""``daskpipe bench symphony``: Symphony's Fig. 6 sweep and its zoo in the simulator."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from daskpipe.benchmarks.symphony import Policy, Trials, compare, fig6_models, load_zoo, zoo_setting


def test_bench_cli_quick_writes_the_sweep_and_the_zoo(tmp_path):
    from daskpipe.cli import main

    out = tmp_path / "symphony.json"
    result = CliRunner().invoke(main, ["bench", "symphony", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    (case,) = figures["fig6"]
    assert [p["beta_over_alpha"] for p in case["points"]] == figures["settings"]["betas_ms"]
    for point in case["points"] + figures["zoo"]:
        assert {"deferred", "eager"} <= set(point["goodput"]) and all(g > 0 for g in point["goodput"].values())
        timeouts = [v for k, v in point["goodput"].items() if k == "eager" or k.startswith("timeout")]
        assert point["best_timeout"]["goodput"] == max(timeouts)
        ratio = point["goodput"]["deferred"] / point["best_timeout"]["goodput"]
        assert point["deferred_over_best_timeout"] == pytest.approx(ratio, rel=1e-3)
    (row,) = figures["zoo"]
    assert row["setting"] == "weak" and "shepherd" in row["goodput"]
    assert figures["paper"]["fig9_symphony_over_baseline_systems"]["1080ti"]["strong"] == 3.5


@pytest.mark.parametrize(
    "option, value, message",
    [("--timeouts", "0.2,1.5", "shares of the SLO"), ("--settings", "mixed,huge", "--settings"), ("--models", "0", ">= 1")],
)
def test_bench_cli_rejects_bad_options(option, value, message):
    from daskpipe.cli import main

    result = CliRunner().invoke(main, ["bench", "symphony", option, value])
    assert result.exit_code != 0 and message in result.output


def test_the_zoos_and_their_settings():
    """Tables 3 and 4, split at beta/alpha = 2 as Fig. 9's strong and weak settings."""
    for zoo, strong, weak in (("1080ti", 23, 12), ("a100", 29, 8)):
        models = load_zoo(zoo)
        assert len(zoo_setting(models, "strong")) == strong and len(zoo_setting(models, "weak")) == weak
        assert len(zoo_setting(models, "mixed")) == strong + weak
    with pytest.raises(ValueError, match="unknown zoo"):
        load_zoo("v100")


def test_deferred_gains_over_eager_as_beta_over_alpha_grows():
    """Fig. 6a on a small cluster (4 models sharing 8 GPUs): with a strong batching effect
    (beta/alpha 15) deferred's goodput is above eager's, and its ratio to eager is higher than
    with almost none (beta/alpha 1), seed by seed."""
    eager_and_deferred = [Policy("deferred"), Policy("eager")]
    ratios = {}
    for beta in (1.0, 15.0):
        result = compare(fig6_models(4, beta), 8, eager_and_deferred, Trials(seeds=(1, 2), duration=0.3))
        per_seed = result["goodput_per_seed"]
        ratios[beta] = [d / e for d, e in zip(per_seed["deferred"], per_seed["eager"])]
    assert all(r > 1 for r in ratios[15.0]), ratios
    assert all(strong > weak for strong, weak in zip(ratios[15.0], ratios[1.0])), ratios

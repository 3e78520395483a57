"""``bench capacity``'s comparison of input sizes at the offered rates every shape met."""

from daskpipe.benchmarks.capacity import against_floor, at_common_rates


def _trial(rate: float, requests: int, cpu_s: float, attainment: float = 1.0, wall_s: float = 3.0) -> dict:
    return {"offered_rate_per_s": rate, "requests": requests, "scheduler_cpu_s": cpu_s, "wall_s": wall_s, "attainment": attainment}


def _run(idle_share: float, trials: list[dict]) -> dict:
    return {"scheduler_idle_measured_share": idle_share, "trials": trials}


def test_sizes_compare_over_the_rates_every_shape_met_above_each_idle_share():
    small = {
        "input_bytes": 49_152,
        "senders": {"1": _run(0.05, [_trial(10, 30, 0.21), _trial(13, 39, 0.24), _trial(16.9, 51, 0.3), _trial(22, 66, 0.4)])},
    }
    # the large input's ladder stops sooner: its third rate missed the bar
    large = {
        "input_bytes": 6_291_456,
        "senders": {"1": _run(0.02, [_trial(10, 30, 0.12), _trial(13, 39, 0.15), _trial(16.9, 51, 0.5, attainment=0.9)])},
    }
    out = at_common_rates({"3,512,1024": large, "3,64,64": small})["1"]
    assert out["offered_rates_per_s"] == [10, 13]
    # above idle: small (0.21 - 0.15 + 0.24 - 0.15) / 69 requests; large (0.12 - 0.06 + 0.15 - 0.06) / 69
    small_us, large_us = 0.15 / 69 * 1e6, 0.15 / 69 * 1e6
    assert abs(out["scheduler_cpu_us_per_request_above_idle"]["3,64,64"] - small_us) < 1e-6
    assert abs(out["scheduler_cpu_us_per_request_above_idle"]["3,512,1024"] - large_us) < 1e-6
    assert abs(out["ratio_to_smallest_input"]["3,512,1024"] - 1.0) < 1e-9


def test_a_sender_count_without_a_rate_every_shape_met_is_left_out():
    small = {"input_bytes": 100, "senders": {"1": _run(0.0, [_trial(10, 30, 0.1)]), "2": _run(0.0, [_trial(10, 30, 0.1)])}}
    large = {
        "input_bytes": 10_000,
        "senders": {"1": _run(0.0, [_trial(10, 30, 0.2)]), "2": _run(0.0, [_trial(10, 30, 0.3, attainment=0.5)])},
    }
    out = at_common_rates({"small": small, "large": large})
    assert list(out) == ["1"]
    assert abs(out["1"]["ratio_to_smallest_input"]["large"] - 2.0) < 1e-9


def test_the_floor_sits_beside_each_ladder_that_offered_its_rate():
    small = {"input_bytes": 100, "senders": {"1": _run(0.1, [_trial(10, 30, 0.6), _trial(13, 39, 0.69)])}}
    large = {"input_bytes": 10_000, "senders": {"1": _run(0.1, [_trial(10, 30, 0.9, attainment=0.5)])}}
    floor = [
        {"offered_rate_per_s": 10, "requests": 30, "relay_cpu_us_per_request": 5000.0},
        {"offered_rate_per_s": 13, "requests": 39, "relay_cpu_us_per_request": 7000.0},
    ]
    at_10, at_13 = against_floor({"small": small, "large": large}, floor)
    # above idle at 10 req/s: small (0.6 - 0.3) / 30 = 10 ms a request, large (0.9 - 0.3) / 30 = 20 ms
    assert abs(at_10["scheduler"]["small"]["1"]["scheduler_cpu_us_per_request_above_idle"] - 10_000) < 1e-6
    assert abs(at_10["scheduler"]["large"]["1"]["ratio_to_floor"] - 4.0) < 1e-9
    assert at_10["scheduler"]["large"]["1"]["attainment"] == 0.5
    assert list(at_13["scheduler"]) == ["small"] and abs(at_13["scheduler"]["small"]["1"]["ratio_to_floor"] - 10_000 / 7000) < 1e-9


def test_the_hold_only_plan_serves_no_more_frames_than_its_workers_nic_carries():
    from daskpipe.benchmarks.capacity import BATCH, BW_GBPS, HOLD_US, SLOTS, hold_only_plan

    _, small = hold_only_plan((3, 64, 64))
    _, large = hold_only_plan((3, 512, 1024))
    assert small.objective == SLOTS * BATCH / (HOLD_US * 1e-6)  # 49 KB inputs: the hold is the limit
    assert abs(large.objective - BW_GBPS * 1e9 / (8 * 4 * 3 * 512 * 1024)) < 1e-6  # 6.3 MB frames: the slots share one NIC

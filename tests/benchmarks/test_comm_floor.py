"""The comm floor of ``bench capacity``: a relay over Dask's comm answers every request of its trials."""

from daskpipe.benchmarks.comm_floor import relay_floor
from daskpipe.benchmarks.serve import poisson_due


def test_the_relay_answers_every_request_of_each_rate_and_reports_its_cpu_per_request():
    figures = relay_floor([50.0, 100.0], 1.0, [1, 2])
    assert [f["offered_rate_per_s"] for f in figures] == [50.0, 100.0]
    for f, seed in zip(figures, [1, 2]):
        assert f["requests"] == len(poisson_due(f["offered_rate_per_s"], 1.0, seed * 1000)) > 0
        assert 0 < f["relay_cpu_us_per_request"] < 1e6

"""At low load no waiting for nothing: lone requests on an idle cluster take their compute, not their SLO."""

from __future__ import annotations

import time

from tests.runtime.helpers import counted, deploy_two_stage, frames

SLO_S = 1.0  # generous: a lone request takes 15-30 ms over TCP here, up to 135 ms over TLS on a busy machine


def test_lone_requests_on_an_idle_cluster_finish_well_within_their_slo(emulated_inproc):
    """The default data plane, an SLO of 1 s, stages of 4 and 6 ms: each of ten requests is sent
    once the answer to the last one is in hand, so none ever finds another outstanding, and none
    waits for a batch that nothing would fill (before, each took its whole SLO)."""
    cluster, client = emulated_inproc
    with deploy_two_stage(client, slo_ms=SLO_S * 1e3) as svc:
        latencies = []
        for x in frames(10):
            sent = time.monotonic()
            svc.submit("tiny", x).result(timeout=30)
            latencies.append(time.monotonic() - sent)
        assert max(latencies) < 0.3 * SLO_S, latencies
        status = counted(svc, "tiny", 10)
        assert status["completed"] == status["on_time"] == 10 and not status["dropped"], status

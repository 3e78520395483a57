"""daskpipe over Dask's TLS comms (``tls://`` with certificates from a throwaway CA).

The in-process tests of the runtime run over TLS too (the ``emulated_inproc`` fixture is
parametrized over tcp and tls), but those marked ``protocols("tcp")``; here: the processes cluster, whose
feature maps cross process boundaries over TLS, the door staying shut to those without a
certificate, and ``daskpipe worker --tls-*`` joining a TLS scheduler.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster
from distributed.comm import connect
from distributed.security import Security

from daskpipe.cli import main
from daskpipe.runtime.cluster import EmulatedCluster
from tests.runtime.helpers import serve_at_load_factor, tls_security

pytestmark = pytest.mark.timeout(180)


def test_processes_cluster_over_tls_serves_at_load_factor_0_7(tmp_path):
    serve_at_load_factor("tls", k=20.0, security=tls_security(tmp_path))


def test_a_tls_cluster_refuses_clients_without_a_certificate(tmp_path):
    """Dask's own connect, each attempt hard-bounded: a ``Client`` whose constructor fails leaves a
    half-made client behind whose clean-up can hang a later test."""

    async def attempt(address: str, security: Security) -> None:
        comm = await asyncio.wait_for(connect(address, timeout=2, **security.get_connection_args("client")), 10)
        await comm.close()

    with EmulatedCluster({"L4": 1}, processes=False, protocol="tls", security=tls_security(tmp_path), dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://")
        with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):  # no TLS set up: not even a handshake
            asyncio.run(attempt(address, Security()))
        with pytest.raises((OSError, asyncio.TimeoutError)):  # plain TCP to the TLS port: no Dask handshake comes back
            asyncio.run(attempt(address.replace("tls://", "tcp://"), Security()))
        (tmp_path / "other").mkdir()
        with pytest.raises((OSError, asyncio.TimeoutError)):  # a certificate from another CA is not trusted
            asyncio.run(attempt(address, tls_security(tmp_path / "other")))


def test_daskpipe_worker_joins_a_tls_scheduler_with_its_certificate(tmp_path):
    security = tls_security(tmp_path)
    with (
        LocalCluster(n_workers=0, processes=False, protocol="tls", security=security, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        command = [
            sys.executable,
            "-c",
            "from daskpipe.cli import main; main()",
            "worker",
            cluster.scheduler_address,
            "--emulate",
            "T4:1",
            "--server",
            "tls-node",
            "--tls-ca-file",
            security.tls_ca_file,
            "--tls-cert",
            security.tls_worker_cert,
        ]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(1, timeout=60)
            ((address, info),) = client.scheduler_info()["workers"].items()
            assert address.startswith("tls://") and info["name"] == "tls-node/T4-0/0"
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0


def test_daskpipe_worker_wants_a_ca_and_a_certificate_for_tls(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    result = CliRunner().invoke(main, ["worker", "tls://127.0.0.1:1", "--tls-ca-file", str(ca)])
    assert result.exit_code == 2 and "needs both --tls-ca-file and --tls-cert" in result.output

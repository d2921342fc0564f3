"""The rig's router binds its ports a while after they were picked (its import alone takes
seconds on a busy machine; before it started beside the servers, a minute or more); a port
taken meanwhile must cost the router a start on other ports, not the test (CI once lost a
pair to it)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from dsv4_idxk_probe.testbed.sglang import launch


def test_a_router_whose_port_was_taken_starts_again_on_another(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        servers = launch.free_ports(4, avoid={taken})  # nothing listens there: no worker gets healthy
        ports = launch.Ports(servers[0], servers[1], servers[2], taken, servers[3])
        cluster = launch.Cluster(tmp_path, ports, launch.ServerOptions())
        env = launch.server_env(dict(os.environ), launch.rig_plugin_site(tmp_path / "site"), tmp_path, "router")
        try:
            with pytest.raises(launch.LaunchError) as failure:
                launch._start_router(cluster, env, time.monotonic() + 25.0)
        finally:
            cluster.stop()
    assert not isinstance(failure.value, launch.PortTaken), str(failure.value)[-2000:]
    assert "no healthy prefill and decode workers" in str(failure.value)
    assert cluster.ports.router != taken
    assert f"127.0.0.1:{cluster.ports.router}" in (tmp_path / "router.log").read_text(errors="replace")

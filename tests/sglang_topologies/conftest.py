"""Production topologies in the SGLang rig: several ranks per side, two hosts, Mooncake.

Every pair here is SGLang's own prefill and decode servers (docs/rig.md, "Topologies").
The module shares one `pairs` fixture that keeps at most one pair running: asking for
another stops the one before (the 2-core CI machine runs one pair at a time), and the
tests are ordered by pair so each starts once.
"""

from __future__ import annotations

import os
import time

import pytest

from dsv4_idxk_probe.testbed.sglang import launch
from dsv4_idxk_probe.testbed.sglang.netns import Hosts, NetnsError
from dsv4_idxk_probe.testbed.sglang.run import RigSession


#: A pair of several ranks a side starts in 3.5-5 minutes on two shared cores (docs/rig.md).
START_TIMEOUT_S = 600.0


class Pairs:
    """The module's server pairs, started on first use, one at a time."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._name: str | None = None
        self._session: RigSession | None = None
        self._hosts: Hosts | None = None
        self.started_s: dict[str, float] = {}

    def get(self, name: str, options: launch.ServerOptions, *, probe_config: str = "step_interval: 4\n",
            env: dict[str, str] | None = None, two_hosts: bool = False) -> RigSession:
        if self._name == name and self._session is not None:
            return self._session
        self.close()
        if two_hosts:
            why = Hosts.unavailable()
            if why is not None:
                pytest.skip(f"two hosts need network namespaces: {why}")
            try:
                self._hosts = Hosts.make()
            except NetnsError as exc:
                pytest.skip(f"two hosts need network namespaces: {exc}")
            options = launch.ServerOptions(**{**options.__dict__, "hosts": self._hosts})
        run_dir = self._tmp.mktemp(name)
        if "{secret}" in probe_config:
            secret = run_dir / "exchange.secret"
            secret.write_bytes(os.urandom(32))
            secret.chmod(0o600)
            probe_config = probe_config.replace("{secret}", str(secret))
        base = dict(os.environ)
        base.update(env or {})
        session = RigSession(run_dir, options, probe_config=probe_config, env=base)
        t0 = time.monotonic()
        try:
            session.start(timeout_s=START_TIMEOUT_S)
        except launch.LaunchError as exc:
            self.close()
            pytest.fail(f"the SGLang pair {name} did not start: {exc}", pytrace=False)
        self.started_s[name] = time.monotonic() - t0
        self._name, self._session = name, session
        return session

    def close(self) -> None:
        if self._session is not None:
            self._session.stop()
        if self._hosts is not None:
            self._hosts.remove()
        self._name = self._session = self._hosts = None


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    p = Pairs(tmp_path_factory)
    yield p
    p.close()

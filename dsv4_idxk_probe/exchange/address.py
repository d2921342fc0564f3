"""Where the exchange may listen: loopback freely, anything else only with a secret.

A wildcard (``0.0.0.0``, ``::``) or routable address exposes the server to
every host that can route to it, so it is refused unless peers authenticate
(`exchange.secret_file`), and logged once at WARNING when allowed.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("dsv4_idxk_probe.exchange")

WILDCARDS = {"0.0.0.0", "::", "*", ""}
_warned: set[str] = set()


class BindRefused(ValueError):
    """An address the exchange must not listen on with this configuration."""


def scope(host: str) -> str:
    """'loopback', 'wildcard' or 'routable'."""
    host = host.strip().strip("[]")
    if host in WILDCARDS:
        return "wildcard"
    if host == "localhost":
        return "loopback"
    try:
        return "loopback" if ipaddress.ip_address(host).is_loopback else "routable"
    except ValueError:  # a host name: whatever it resolves to, it is not known to be loopback
        return "routable"


def check_bind(host: str, authenticated: bool) -> str:
    """The address's scope; BindRefused when it is not loopback and peers do not authenticate."""
    kind = scope(host)
    if kind == "loopback":
        return kind
    if not authenticated:
        raise BindRefused(
            f"exchange refuses to listen on {kind} address {host!r} without peer authentication: "
            "set exchange.secret_file (or DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE) on prefill and decode, "
            "or bind 127.0.0.1 (docs/security.md)"
        )
    if host not in _warned:
        _warned.add(host)
        log.warning("dsv4-idxk-probe exchange listens on %s address %s; peers authenticate with the shared secret",
                    kind, host)
    return kind

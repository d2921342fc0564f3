"""The address SGLang's KV manager reports to its peers from this host.

Prefill's exchange binds that address under ``exchange.bind: auto``; without a
secret it must stay on loopback, so decode on another host cannot fetch digest
vectors. `check` uses this to say so before a pod finds out. SGLang's
``CommonKVManager`` takes ``get_local_ip_auto()`` (``SGLANG_HOST_IP`` /
``HOST_IP``, else the NIC, else the route out), in ``sglang.srt.utils.network``
on 0.5.18-0.5.23.
"""

from __future__ import annotations


def kv_manager_address() -> tuple[str | None, str]:
    """(the address, "") or (None, why it could not be found)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except Exception as exc:  # an SGLang without it, or one that cannot be imported
        return None, f"{type(exc).__name__}: {exc}"
    try:
        address = get_local_ip_auto()
    except Exception as exc:  # "Can not get local ip"
        return None, f"{type(exc).__name__}: {exc}"
    return (str(address), "") if address else (None, "SGLang found no address")

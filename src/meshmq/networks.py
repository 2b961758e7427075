"""CIDR network lists, as the configuration gives them (``limits.allow``, ``deny``...).

A leaf module: the configuration checks them and the admission rules
(broker/transport/admission.py) use them, with one parser.
"""

from __future__ import annotations

import ipaddress

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """Parse a comma-separated list of CIDR networks ('10.0.0.0/8, ::1'); '' gives ().

    A bare address is a one-address network; host bits are ignored (10.1.2.3/8 = 10.0.0.0/8).
    Raises ``ValueError`` with a one-line message naming the bad item.
    """
    networks: list[IPNetwork] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            shown = item if len(item) <= 60 else item[:57] + "..."
            raise ValueError(
                f"{shown!r} is not an IP network (CIDR such as 10.0.0.0/8 or 2001:db8::/32)"
            ) from None
    return tuple(networks)

"""Fetching the router's and the pods' /metrics: targets are host:port or dns:name:port (every address
the name resolves to, as the router discovers pods), scraped concurrently with a timeout."""
from __future__ import annotations

import asyncio
import socket
import urllib.request
from dataclasses import dataclass

from planner.readings import Reading, parse_reading


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    is_dns: bool = False


def parse_target(text: str) -> Target:
    spec = text.strip()
    is_dns = spec.startswith("dns:")
    if is_dns:
        spec = spec[len("dns:"):]
    host, sep, port = spec.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"bad metrics target {text!r}: expected host:port or dns:name:port")
    return Target(host, int(port), is_dns)


def parse_targets(values: list[str] | tuple[str, ...] | None) -> tuple[Target, ...]:
    targets: list[Target] = []
    for value in values or ():
        for part in str(value).split(","):
            if part.strip() and parse_target(part) not in targets:
                targets.append(parse_target(part))
    return tuple(targets)


def _addresses(target: Target) -> list[str]:
    if not target.is_dns:
        return [_url_host(target.host, target.port)]
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []  # no pod behind the name yet
    return sorted({_url_host(info[4][0], target.port) for info in infos})


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _fetch(address: str, timeout_s: float) -> Reading:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
        return parse_reading(response.read().decode())


async def scrape(targets: tuple[Target, ...], timeout_s: float) -> tuple[dict[str, Reading], list[str]]:
    """Readings by address from every target's addresses, and the addresses that did not answer."""
    address_lists = await asyncio.gather(*(asyncio.to_thread(_addresses, t) for t in targets))
    addresses = sorted({a for found in address_lists for a in found})
    results = await asyncio.gather(*(asyncio.to_thread(_fetch, a, timeout_s) for a in addresses),
                                   return_exceptions=True)
    readings = {a: r for a, r in zip(addresses, results) if isinstance(r, Reading)}
    failed = [a for a, r in zip(addresses, results) if not isinstance(r, Reading)]
    return readings, failed

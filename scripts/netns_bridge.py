"""Hosts on one machine: network namespaces, each with its own address, joined by veth pairs to a bridge in
a hub namespace. Used by the image job (scripts/image_lab.py) and the namespace tests (tests/test_netns.py)."""
from __future__ import annotations

import subprocess


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def make_bridge(hub: str, hosts: dict[str, tuple[str, str]], suffix: str, made: list[str],
                hub_address: str | None = None) -> None:
    """hosts: name -> (namespace, address/24). Each namespace made is appended to `made` at once, so the
    caller's cleanup removes it even when a later step fails. hub_address: the bridge's own address."""
    for namespace in (hub, *(namespace for namespace, _ in hosts.values())):
        ip("netns", "add", namespace)
        made.append(namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
    ip("-n", hub, "link", "add", "br0", "type", "bridge")
    if hub_address is not None:
        ip("-n", hub, "addr", "add", f"{hub_address}/24", "dev", "br0")
    ip("-n", hub, "link", "set", "br0", "up")
    for name, (namespace, address) in hosts.items():
        # Made inside the hub, then one end moved: nothing ever appears in the caller's namespace.
        inner, outer = f"v{name[:2]}{suffix}", f"h{name[:2]}{suffix}"
        ip("-n", hub, "link", "add", inner, "type", "veth", "peer", "name", outer)
        ip("-n", hub, "link", "set", inner, "netns", namespace)
        ip("-n", hub, "link", "set", outer, "master", "br0", "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", namespace, "link", "set", inner, "up")


def remove_namespaces(made: list[str]) -> None:
    """Deletes the namespaces (their veth ends go with them), newest first; empties `made`."""
    for namespace in reversed(made):
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    made.clear()

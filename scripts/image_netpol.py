"""Kubernetes NetworkPolicies, as rendered from k8s/, turned into one nftables ruleset per pod (the image
job's stand-in for a CNI that enforces them): a pod selected by a policy of a direction accepts, in that
direction, only what some selecting policy allows; traffic to and from the node (kubelet's probes) always."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict[str, str]
    address: str


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    if selector.get("matchExpressions"):
        raise ValueError(f"matchExpressions are not translated here: {selector}")
    return all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items())


def _peer_addresses(peer: dict, pods: list[Pod]) -> set[str] | None:
    """The addresses a peer names; None for any address. Every namespace here holds only these pods, so a
    namespaceSelector {} alone is "anywhere", and with a podSelector it is those pods wherever they are."""
    if "ipBlock" in peer:
        if peer["ipBlock"].get("except"):
            raise ValueError(f"ipBlock.except is not translated here: {peer}")
        return None if peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0") else {peer["ipBlock"]["cidr"]}
    if "podSelector" not in peer:
        return None
    return {pod.address for pod in pods if _matches(peer["podSelector"], pod.labels)}


def _ports(ports: list[dict] | None) -> list[str]:
    """nft matches for a rule's ports: one per protocol; [""] (no match, every port) when none are named."""
    if not ports:
        return [""]
    by_protocol: dict[str, list[str]] = {}
    for port in ports:
        if not isinstance(port.get("port"), int):
            raise ValueError(f"only numeric ports are translated here: {port}")
        text = f"{port['port']}-{port['endPort']}" if "endPort" in port else str(port["port"])
        by_protocol.setdefault(port.get("protocol", "TCP").lower(), []).append(text)
    return [f"{protocol} dport {{ {', '.join(numbers)} }} " for protocol, numbers in by_protocol.items()]


def _rule_lines(rule: dict, peer_key: str, address_key: str, pods: list[Pod]) -> list[str]:
    peers = rule.get(peer_key)
    if peers:
        found = [_peer_addresses(peer, pods) for peer in peers]
        addresses = None if any(entry is None for entry in found) else set().union(*found)
        if addresses is not None and not addresses:
            return []  # selects no pod here (kube-dns): allows nothing
    else:
        addresses = None
    where = "" if addresses is None else f"ip {address_key} {{ {', '.join(sorted(addresses))} }} "
    return [f"{where}{ports}accept" for ports in _ports(rule.get("ports"))]


def _direction(pod: Pod, pods: list[Pod], policies: list[dict], kind: str) -> list[str] | None:
    """The accept rules of one direction ("Ingress" or "Egress"), or None when no policy isolates it."""
    peer_key, address_key = ("from", "saddr") if kind == "Ingress" else ("to", "daddr")
    selecting = [p["spec"] for p in policies if _matches(p["spec"]["podSelector"], pod.labels)
                 and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return None
    lines = []
    for spec in selecting:
        for rule in spec.get(kind.lower()) or []:
            lines += _rule_lines(rule, peer_key, address_key, pods)
    return lines


def ruleset(pod: Pod, pods: list[Pod], policies: list[dict], node_address: str) -> str:
    """The nft ruleset for one pod's network namespace."""
    chains = []
    for kind, chain, hook, device, node_match in (("Ingress", "input", "input", "iif", "saddr"),
                                                    ("Egress", "output", "output", "oif", "daddr")):
        rules = _direction(pod, pods, policies, kind)
        policy = "accept" if rules is None else "drop"
        body = [f"type filter hook {hook} priority 0; policy {policy};", f"{device} lo accept",
                "ct state established,related accept", f"ip {node_match} {node_address} accept",
                *(f"{line}" for line in rules or [])]
        chains.append(f"  chain {chain} {{\n" + "".join(f"    {line}\n" for line in body) + "  }\n")
    return "table inet pdserve {\n" + "".join(chains) + "}\n"


def describe(pod: Pod, pods: list[Pod], policies: list[dict]) -> str:
    """One line for the job's output: how many accept rules each direction got."""
    parts = []
    for kind in ("Ingress", "Egress"):
        rules = _direction(pod, pods, policies, kind)
        parts.append(f"{kind.lower()} {'open' if rules is None else f'{len(rules)} accept rule(s), else drop'}")
    return f"{pod.name}: " + "; ".join(parts)

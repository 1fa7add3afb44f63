"""The address a prefill pod puts in its KV handles: the decode pods dial it for GetKvSource and ReleaseKv."""
from __future__ import annotations

import ipaddress
import socket

import pytest

from shared.engine.kv_transfer.connector import KVRole
from shared.serving.pod import serve as pod_server
from shared.serving.pod.runtime import PodConfig


def test_a_prefill_pod_bound_to_one_address_advertises_it():
    assert pod_server.advertised(PodConfig(), KVRole.PRODUCER, "10.1.2.3", 50061).advertise_address == "10.1.2.3:50061"
    given = PodConfig(advertise_address="pod.example:50061")
    assert pod_server.advertised(given, KVRole.PRODUCER, "0.0.0.0", 50061) is given
    assert pod_server.advertised(PodConfig(), KVRole.CONSUMER, "0.0.0.0", 50071).advertise_address == ""


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_prefill_pod_bound_to_every_address_advertises_one_of_this_host(wildcard):
    # Advertising 0.0.0.0 would make every decode pod dial itself.
    try:
        config = pod_server.advertised(PodConfig(), KVRole.PRODUCER, wildcard, 50061)
    except ValueError:
        pytest.skip("this machine has no default route")
    host, port = config.advertise_address.rsplit(":", 1)
    assert port == "50061" and not ipaddress.ip_address(host).is_unspecified
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((host, 0))  # an address this host owns


def test_without_a_default_route_it_asks_for_advertise_address(monkeypatch):
    def unroutable(self, address):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unroutable)
    with pytest.raises(ValueError, match="--advertise-address"):
        pod_server.advertised(PodConfig(), KVRole.PRODUCER, "0.0.0.0", 50061)

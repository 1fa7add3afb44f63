"""pdserve.launcher.free_port: ports for local services, outside the kernel's ephemeral range (where any
outgoing connection may take a port between the pick and the service's bind), never one in use."""
import socket

import pytest

from pdserve import launcher


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    for _ in range(20):
        port = launcher.free_port()
        assert 10000 <= port < 20000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((launcher.HOST, port))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((launcher.HOST, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(launcher, "_SERVICE_PORTS", range(busy, busy + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            launcher.free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((launcher.HOST, 0))
            spare = probe.getsockname()[1]
        monkeypatch.setattr(launcher, "_SERVICE_PORTS", [busy, spare])
        monkeypatch.setattr(launcher, "_handed_out", set())
        assert launcher.free_port() == spare


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch):
    """A port is free until its service binds it: a second pick before then (the same service's metrics
    port, the next pod) must not get it too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((launcher.HOST, 0))
        spare = probe.getsockname()[1]
    monkeypatch.setattr(launcher, "_SERVICE_PORTS", [spare])
    monkeypatch.setattr(launcher, "_handed_out", set())
    assert launcher.free_port() == spare
    with pytest.raises(RuntimeError, match="no free port"):
        launcher.free_port()

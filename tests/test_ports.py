"""twinspark.ports.free_port: below the ephemeral range, bindable, skips ports in use, clear error."""

from __future__ import annotations

import socket

import pytest
from twinspark import ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    first_ephemeral = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOW <= port < first_ephemeral
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen()
        taken, free = busy.getsockname()[1], ports.free_port()
        picks = iter([taken, free])

        class Picks:
            def randrange(self, lo, hi):
                return next(picks)

        monkeypatch.setattr(ports.random, "Random", Picks)
        assert ports.free_port() == free


def test_free_port_says_what_to_do_when_none_is_free():
    with pytest.raises(OSError, match="no free TCP port .* stop some servers"):
        ports.free_port(tries=0)

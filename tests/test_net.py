"""The local rendezvous port (fastddp._net.free_port), used by the launcher and the tests."""

from __future__ import annotations

import random
import socket

from fastddp import _net


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    start = _net._ephemeral_start()
    state = random.getstate()
    ports = {_net.free_port() for _ in range(20)}
    assert random.getstate() == state  # the script's random state is left alone
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
        if start - _net._FIRST_PORT >= 1024:
            assert _net._FIRST_PORT <= port < start, (port, start)
            assert port not in _net._TORCH_DEFAULTS


def test_free_port_skips_a_taken_port(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        draws = iter([busy, busy])

        def draw(self: random.Random, a: int, b: int) -> int:
            return next(draws, None) or _kernel_port()  # the taken port twice, then free ones

        monkeypatch.setattr(_net, "_ephemeral_start", lambda: 65000)
        monkeypatch.setattr(random.Random, "randrange", draw)
        assert _net.free_port() not in (busy, None)


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""``serve.start_all`` waits for its servers together: the first one to fail raises at once (review of session 34:
a server that exited at start was reported only once the servers before it were ready or timed out, up to the
startup timeout); a server that found its port taken is moved and started again."""

from __future__ import annotations

import time

import pytest

from sglang_spex import serve


class _Fake:
    def __init__(self, delay: float, results=(True,), exc: bool = False):
        self.delay, self.results, self.exc, self.spawns, self.moves = delay, list(results), exc, 0, 0

    def attempts(self, attempts: int = 3) -> int:
        return attempts

    def spawn(self) -> None:
        self.spawns += 1

    def ready(self) -> bool:
        time.sleep(self.delay)
        if self.exc:
            raise RuntimeError("server exited with 1")
        return self.results.pop(0)

    def move_to_free_port(self) -> None:
        self.moves += 1

    def log_tail(self) -> str:
        return "log"


@pytest.fixture(autouse=True)
def _fake_wait(monkeypatch):
    monkeypatch.setattr(serve.ServerProcess, "wait_ready", lambda s: s.ready())


def test_the_first_failure_raises_without_waiting_for_the_others():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited"):
        serve.start_all([_Fake(3.0), _Fake(0.05, exc=True)])
    assert time.monotonic() - t0 < 2.0


def test_a_server_whose_port_was_taken_starts_again():
    slow, taken = _Fake(0.05), _Fake(0.0, results=(False, True))
    serve.start_all([slow, taken])
    assert (slow.spawns, taken.spawns, taken.moves) == (1, 2, 1)

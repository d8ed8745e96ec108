"""math-verify under a hard time limit: it runs in a child process that is killed when a comparison runs long.

math-verify's own timeouts use ``signal.alarm``: they work only in a main thread and cannot interrupt a long C call
(``9^{9^{9}}`` is one big-integer power that runs for minutes and takes gigabytes). A reference or an answer comes
from a client, so the comparison runs in one long-lived ``spawn`` child (started at the first comparison;
importing sympy takes seconds) and the caller waits at most ``timeout_s``; past that the child is killed (and
started again at the next comparison) and the answer counts as not verified. Comparisons are serialised, and a
caller waits at most ``wait_s`` for its turn (else: not verified), so a client whose references keep the child busy
cannot hold other searches' results for long; call this off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any, Optional

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 2.0  # one comparison, past which the child is killed
WAIT_S = 5.0  # a comparison's wait for the comparisons queued before it
START_TIMEOUT_S = 120.0  # the child's start (it imports math-verify and sympy)


def _serve(conn: Connection) -> None:
    """The child: answer ``(reference, answer)`` with True / False (None: math-verify raised)."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns at every call that its timeouts are off
    conn.send("ready")
    while True:
        try:
            reference, answer = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out: Optional[bool] = bool(
                verify(
                    parse(f"${reference}$", parsing_timeout=None),
                    parse(f"${answer}$", parsing_timeout=None),
                    timeout_seconds=None,
                )
            )
        except Exception:
            out = None
        conn.send(out)


class MathChecker:
    """One child process running math-verify; :meth:`equal` waits for it at most ``timeout_s``."""

    def __init__(self, timeout_s: float = VERIFY_TIMEOUT_S, wait_s: float = WAIT_S):
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.killed = 0  # comparisons that ran past the limit
        self.busy = 0  # comparisons not run: the child stayed busy past ``wait_s``
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Optional[Connection] = None

    def equal(self, answer: str, reference: str) -> Optional[bool]:
        """Whether math-verify finds ``answer`` equal to ``reference``; None when it raised, ran past the limit,
        waited past ``wait_s`` for its turn or its child could not start."""
        if not self._lock.acquire(timeout=self.wait_s):
            self.busy += 1
            logger.warning("math-verify busy for %gs; %r vs %r not verified", self.wait_s, answer[:80], reference[:80])
            return None
        try:
            try:
                conn = self._ready()
                conn.send((reference, answer))
                if conn.poll(self.timeout_s):
                    return conn.recv()
            except (OSError, EOFError, RuntimeError) as e:
                logger.warning("math-verify child failed: %r", e)
                self._stop()
                return None
            self.killed += 1
            logger.warning(
                "math-verify ran past %gs on %r vs %r; child killed", self.timeout_s, answer[:80], reference[:80]
            )
            self._stop()
            return None
        finally:
            self._lock.release()

    def _ready(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self._stop()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child,), name="spex-math-verify", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(START_TIMEOUT_S) or parent.recv() != "ready":
            raise RuntimeError(f"the math-verify child did not start within {START_TIMEOUT_S:g}s")
        return parent

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None


CHECKER = MathChecker()  # the process's one child, shared by every caller

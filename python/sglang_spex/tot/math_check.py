"""Client-supplied answers judged under a hard time limit: math-verify comparisons and ``reasoning_gym`` scorers
run in a child process that is killed when one runs long.

math-verify's own timeouts use ``signal.alarm``: they work only in a main thread and cannot interrupt a long C call
(``9^{9^{9}}`` is one big-integer power that runs for minutes and takes gigabytes); a ``reasoning_gym`` scorer has
no time limit at all. A reference or an answer comes from a client, so both run in one long-lived ``spawn`` child
(started at the first comparison; importing sympy takes seconds, and the first scoring of each ``reasoning_gym``
dataset loads it there, under the start's limit) and the caller waits at most ``timeout_s``; past that the child is
killed (and started again at the next call) and the answer counts as not verified. Calls are serialised, and a
caller waits at most ``wait_s`` for its turn (else: not verified), so a client whose references keep the child busy
cannot hold other searches' results for long; call this off the event loop (``asyncio.to_thread``).

The child runs the scorer it is given: which ``reasoning_gym`` scorers are safe to run on a client's text (none
that evaluates it as code) is decided by the caller (:class:`~sglang_spex.tot.tasks.ReasoningGymTask`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional, Set, Tuple

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 2.0  # one comparison or scoring, past which the child is killed
WAIT_S = 5.0  # a call's wait for the calls queued before it
START_TIMEOUT_S = 120.0  # the child's start (it imports math-verify and sympy), or its loading of one rg dataset


class ScorerRaised(Exception):
    """A ``reasoning_gym`` scorer (or its dataset's construction) raised in the child; the message says what."""


def _math_equal(reference: str, answer: str) -> Optional[bool]:
    from math_verify import parse, verify

    try:
        return bool(
            verify(
                parse(f"${reference}$", parsing_timeout=None),
                parse(f"${answer}$", parsing_timeout=None),
                timeout_seconds=None,
            )
        )
    except Exception:
        return None


def _rg_load(scorers: Dict[str, Any], key: str, dataset: str, config: Dict[str, Any]) -> Optional[str]:
    try:
        import reasoning_gym

        scorers[key] = reasoning_gym.create_dataset(dataset, size=1, seed=0, **config)
        return None
    except Exception as e:
        return repr(e)[:300]


def _rg_score(scorers: Dict[str, Any], key: str, answer: str, entry: Dict[str, Any]) -> Tuple[bool, Any]:
    try:
        return True, float(scorers[key].score_answer(answer, entry))
    except Exception as e:
        return False, repr(e)[:300]


def _serve(conn: Connection) -> None:
    """The child. Requests: ``("math", reference, answer)`` -> True / False (None: math-verify raised);
    ``("rg_load", key, dataset, config)`` -> None, or what raised building the dataset;
    ``("rg", key, answer, entry)`` -> ``(True, score)``, or ``(False, what raised)``."""
    import math_verify  # noqa: F401  (the slow import, before "ready")

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns at every call that its timeouts are off
    scorers: Dict[str, Any] = {}  # rg datasets by key, loaded at their first scoring
    conn.send("ready")
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "math":
            out: Any = _math_equal(*args)
        elif kind == "rg_load":
            out = _rg_load(scorers, *args)
        else:
            out = _rg_score(scorers, *args)
        conn.send(out)


class MathChecker:
    """One child process running math-verify and ``reasoning_gym`` scorers; each call waits for it at most
    ``timeout_s``."""

    def __init__(self, timeout_s: float = VERIFY_TIMEOUT_S, wait_s: float = WAIT_S):
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.killed = 0  # calls that ran past the limit
        self.busy = 0  # calls not run: the child stayed busy past ``wait_s``
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Optional[Connection] = None
        self._loaded: Set[str] = set()  # rg dataset keys the running child has loaded

    def equal(self, answer: str, reference: str) -> Optional[bool]:
        """Whether math-verify finds ``answer`` equal to ``reference``; None when it raised, ran past the limit,
        waited past ``wait_s`` for its turn or its child could not start."""
        what = f"math-verify on {answer[:80]!r} vs {reference[:80]!r}"
        if not self._turn(what):
            return None
        try:
            done, out = self._ask(("math", reference, answer), self.timeout_s, what)
            return out if done else None
        finally:
            self._lock.release()

    def rg_score(self, dataset: str, config: Dict[str, Any], answer: str, entry: Dict[str, Any]) -> Optional[float]:
        """``reasoning_gym`` dataset ``dataset``'s (built with ``config``) score of ``answer`` for ``entry``; None
        when it ran past the limit, waited past ``wait_s`` for its turn or the child could not start or load the
        dataset in time. Raises :class:`ScorerRaised` when the scorer or the dataset's construction raised.
        Only for a scorer that evaluates no text as code: it runs on a client's text."""
        what = f"rg:{dataset} scorer on {str(answer)[:80]!r} vs {str(entry.get('answer'))[:80]!r}"
        if not self._turn(what):
            return None
        try:
            key = f"{dataset}:{sorted(config.items())!r}"
            if key not in self._loaded:
                done, err = self._ask(("rg_load", key, dataset, config), START_TIMEOUT_S, what)
                if not done:
                    return None
                if err is not None:
                    raise ScorerRaised(err)
                self._loaded.add(key)
            done, out = self._ask(("rg", key, answer, entry), self.timeout_s, what)
            if not done:
                return None
            ok, value = out
            if not ok:
                raise ScorerRaised(value)
            return value
        finally:
            self._lock.release()

    def _turn(self, what: str) -> bool:
        if self._lock.acquire(timeout=self.wait_s):
            return True
        self.busy += 1
        logger.warning("the answer checker was busy for %gs; %s not run", self.wait_s, what)
        return False

    def _ask(self, request: Tuple[Any, ...], timeout_s: float, what: str) -> Tuple[bool, Any]:
        """``(True, reply)`` to ``request``, or ``(False, None)`` when the child failed or ran past ``timeout_s``
        (it is then killed). The caller holds the lock."""
        try:
            conn = self._ready()
            conn.send(request)
            if conn.poll(timeout_s):
                return True, conn.recv()
        except Exception as e:  # OSError, EOFError: the child died; RuntimeError: it did not start
            logger.warning("the answer checker's child failed on %s: %r", what, e)
            self._stop()
            return False, None
        self.killed += 1
        logger.warning("%s ran past %gs; child killed", what, timeout_s)
        self._stop()
        return False, None

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
        self._loaded = set()


CHECKER = MathChecker()  # the process's one child, shared by every caller

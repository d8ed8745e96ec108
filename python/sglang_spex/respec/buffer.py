"""Replay buffer of RL rollouts for the online learner, with strict validation of incoming payloads.

A rollout is ``{"prompt_ids": [int], "response_ids": [int], "reward": float, "target_logprobs": [float]?}``
(``target_logprobs``: the log-prob SGLang returned for each response token, optional). Anything else —
unknown fields, wrong types, empty or out-of-vocabulary ids, NaN/inf, a log-prob list of the wrong length —
raises :class:`RolloutError` naming the field; ``add_batch`` validates the whole batch before storing any.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

FIELDS = ("prompt_ids", "response_ids", "reward", "target_logprobs")
REQUIRED = ("prompt_ids", "response_ids", "reward")


class RolloutError(ValueError):
    """A rollout payload is invalid; ``field`` names the offending field (with its rollout index)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Rollout:
    prompt_ids: tuple
    response_ids: tuple
    reward: float
    target_logprobs: Optional[tuple] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _ids(value: Any, field: str, vocab_size: Optional[int], max_len: int) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise RolloutError(field, f"must be a list of token ids, got {type(value).__name__}")
    if not value:
        raise RolloutError(field, "must not be empty")
    if len(value) > max_len:
        raise RolloutError(field, f"has {len(value)} tokens, more than {max_len}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RolloutError(f"{field}[{i}]", f"must be an int token id, got {type(t).__name__}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise RolloutError(f"{field}[{i}]", f"token id {t} outside [0, {vocab_size})")
    return tuple(value)


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RolloutError(field, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise RolloutError(field, f"must be finite, got {value}")
    return float(value)


def validate_rollout(payload: Any, vocab_size: Optional[int] = None, max_len: int = 32768, where: str = "") -> Rollout:
    """Check one rollout dict and return it as a :class:`Rollout`."""
    if not isinstance(payload, Mapping):
        raise RolloutError(where or "rollout", f"must be an object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise RolloutError(f"{where}{unknown[0]}", f"unknown field (allowed: {', '.join(FIELDS)})")
    for name in REQUIRED:
        if name not in payload:
            raise RolloutError(f"{where}{name}", "missing")
    prompt = _ids(payload["prompt_ids"], f"{where}prompt_ids", vocab_size, max_len)
    response = _ids(payload["response_ids"], f"{where}response_ids", vocab_size, max_len)
    reward = _number(payload["reward"], f"{where}reward")
    logprobs = payload.get("target_logprobs")
    if logprobs is not None:
        field = f"{where}target_logprobs"
        if not isinstance(logprobs, (list, tuple)):
            raise RolloutError(field, f"must be a list of floats, got {type(logprobs).__name__}")
        if len(logprobs) != len(response):
            raise RolloutError(field, f"has {len(logprobs)} entries for {len(response)} response tokens")
        values = [_number(x, f"{field}[{i}]") for i, x in enumerate(logprobs)]
        bad = [i for i, x in enumerate(values) if x > 1e-4]
        if bad:
            raise RolloutError(f"{field}[{bad[0]}]", f"a log-probability must be <= 0, got {values[bad[0]]}")
        logprobs = tuple(values)
    return Rollout(prompt, response, reward, logprobs)


def validate_batch(payloads: Any, vocab_size: Optional[int] = None, max_len: int = 32768) -> List[Rollout]:
    if not isinstance(payloads, (list, tuple)):
        raise RolloutError("rollouts", f"must be a list, got {type(payloads).__name__}")
    if not payloads:
        raise RolloutError("rollouts", "must not be empty")
    return [validate_rollout(p, vocab_size, max_len, where=f"rollouts[{i}].") for i, p in enumerate(payloads)]


class ReplayBuffer:
    """Thread-safe FIFO of validated rollouts; the oldest are dropped beyond ``capacity``."""

    def __init__(self, capacity: int = 4096, vocab_size: Optional[int] = None, max_len: int = 32768):
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.max_len = max_len
        self._items: List[Rollout] = []
        self._lock = threading.Lock()
        self.total_added = 0
        self.dropped = 0

    def add_batch(self, payloads: Sequence[Any]) -> int:
        """Validate all, then store all (atomic: a bad entry stores nothing). Returns the number stored."""
        if isinstance(payloads, (list, tuple)) and payloads and all(isinstance(r, Rollout) for r in payloads):
            rollouts = list(payloads)
        else:
            rollouts = validate_batch(payloads, self.vocab_size, self.max_len)
        with self._lock:
            self._items.extend(rollouts)
            self.total_added += len(rollouts)
            overflow = len(self._items) - self.capacity
            if overflow > 0:
                del self._items[:overflow]
                self.dropped += overflow
        return len(rollouts)

    def drain(self) -> List[Rollout]:
        """Take everything (the paper clears the buffer at each update)."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def snapshot(self) -> List[Rollout]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

"""Replay buffer of RL rollouts for the online learner, with strict validation of incoming payloads.

A rollout is ``{"prompt_ids": [int], "response_ids": [int], "reward": float, "target_logprobs": [float]?,
"target_top_logprobs": [[[int, float], ...], ...]?}``, both optional and from the served target: ``target_logprobs``
is the log-prob SGLang returned for each response token, ``target_top_logprobs`` its top-k per response token as
``[token_id, logprob]`` pairs (:func:`served_fields` builds both from a ``/generate`` ``meta_info``). Anything else —
unknown fields, wrong types, empty or out-of-vocabulary ids, more than ``max_len`` tokens (prompt + response; the
learner's is the model's context), NaN/inf, a positive log-prob, a list of the wrong length, a repeated id or a
top-k row whose probabilities sum past 1 — raises :class:`RolloutError` naming the field; ``add_batch`` validates
the whole batch before storing any. A validated :class:`Rollout` holds its values in numpy arrays (4 bytes per
id or log-prob), not Python objects (~108 bytes each); ``rollout_wire.py`` decodes the same rollouts from a binary
body.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Deque, List, Mapping, Optional, Sequence

import numpy as np

FIELDS = ("prompt_ids", "response_ids", "reward", "target_logprobs", "target_top_logprobs")
REQUIRED = ("prompt_ids", "response_ids", "reward")
MAX_TOP_K = 256  # top-k entries per response token (a bound on the buffer's memory)
DEFAULT_MAX_ENTRIES = 1 << 24  # values the buffer holds (ids, log-probs, top-k cells): ~130 MB as arrays
LOGP_TOL = 1e-4  # a served log-prob may exceed 0 by rounding, no more
LOGP_FLOOR = -1e4  # a log-prob below it is stored as it (p = 0 either way; float32 holds it, not -1e39)
ID_DTYPE, LOGP_DTYPE = np.int32, np.float32  # how a rollout stores token ids and log-probs
PAD_ID = -1  # a top-k cell past the end of its row
ID_LIMIT = int(np.iinfo(ID_DTYPE).max) + 1  # token ids below this, whatever the vocabulary


class RolloutError(ValueError):
    """A rollout payload is invalid; ``field`` names the offending field (with its rollout index)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, eq=False)
class TopK:
    """The served top-k of a rollout's response tokens: row i holds the (token id, log p) pairs of the distribution
    response token i was sampled from, padded past its end with id ``PAD_ID``."""

    ids: np.ndarray  # ID_DTYPE [n, k]
    logp: np.ndarray  # LOGP_DTYPE [n, k]

    def __len__(self) -> int:
        return self.ids.shape[0]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Sequence[Any]]]) -> "TopK":
        """From rows of ``(token_id, logprob)`` pairs (every row non-empty)."""
        k = max(len(row) for row in rows)
        ids = np.full((len(rows), k), PAD_ID, dtype=ID_DTYPE)
        logp = np.zeros((len(rows), k), dtype=LOGP_DTYPE)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = [t for t, _ in row]
            logp[i, : len(row)] = [x for _, x in row]
        return cls(ids, logp)

    def rows(self) -> tuple:
        """The rows as ``((token_id, logprob), ...)`` tuples of Python numbers."""
        return tuple(
            tuple((int(t), float(x)) for t, x in zip(ids, logp) if t != PAD_ID)
            for ids, logp in zip(self.ids, self.logp)
        )

    def logp_of(self, tokens: np.ndarray) -> List[Optional[float]]:
        """Row i's log p of ``tokens[i]`` (None where the token is not in the row)."""
        hit = self.ids == np.asarray(tokens)[:, None]
        found = hit.any(axis=1)
        values = self.logp[np.arange(len(self)), hit.argmax(axis=1)]
        return [float(x) if f else None for x, f in zip(values, found)]


@dataclass(frozen=True, eq=False)
class Rollout:
    prompt_ids: np.ndarray  # ID_DTYPE
    response_ids: np.ndarray  # ID_DTYPE
    reward: float
    target_logprobs: Optional[np.ndarray] = None  # LOGP_DTYPE, one per response token
    target_top_logprobs: Optional[TopK] = None  # one row per response token

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @cached_property
    def entries(self) -> int:
        """Values stored: token ids, log-probs and top-k cells (what the buffer's memory grows with)."""
        top = self.target_top_logprobs.ids.size if self.target_top_logprobs is not None else 0
        return self.num_tokens + len(self.target_logprobs if self.target_logprobs is not None else ()) + top


def _ids(value: Any, field: str, vocab_size: Optional[int], max_len: int) -> Sequence[int]:
    if not isinstance(value, (list, tuple)):
        raise RolloutError(field, f"must be a list of token ids, got {type(value).__name__}")
    if not value:
        raise RolloutError(field, "must not be empty")
    if len(value) > max_len:
        raise RolloutError(field, f"has {len(value)} tokens, more than {max_len}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RolloutError(f"{field}[{i}]", f"must be an int token id, got {type(t).__name__}")
        if t < 0 or t >= (vocab_size if vocab_size is not None else ID_LIMIT):
            raise RolloutError(f"{field}[{i}]", f"token id {t} outside [0, {vocab_size or ID_LIMIT})")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RolloutError(field, f"must be a number, got {type(value).__name__}")
    x = _as_float(value)
    if x is None or not math.isfinite(x):
        shown = value if isinstance(value, float) else f"an integer of {value.bit_length()} bits, past a float's range"
        raise RolloutError(field, f"must be finite, got {shown}")
    return x


def _as_float(value: Any) -> Optional[float]:
    """``float(value)``, or None for an integer past the float range (``float`` raises OverflowError there)."""
    try:
        return float(value)
    except OverflowError:
        return None


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
    if len(prompt) + len(response) > max_len:
        raise RolloutError(
            f"{where}response_ids",
            f"prompt and response have {len(prompt) + len(response)} tokens, more than the {max_len} a rollout may have",
        )
    reward = _number(payload["reward"], f"{where}reward")
    logprobs = payload.get("target_logprobs")
    if logprobs is not None:
        field = f"{where}target_logprobs"
        _rows(logprobs, field, len(response), "floats")
        logprobs = np.array([_logprob(x, f"{field}[{i}]") for i, x in enumerate(logprobs)], dtype=LOGP_DTYPE)
    top = payload.get("target_top_logprobs")
    if top is not None:
        field = f"{where}target_top_logprobs"
        _rows(top, field, len(response), "top-k rows")
        top = TopK.from_rows([_top_row(row, f"{field}[{i}]", vocab_size) for i, row in enumerate(top)])
    return Rollout(np.array(prompt, dtype=ID_DTYPE), np.array(response, dtype=ID_DTYPE), reward, logprobs, top)


def _rows(value: Any, field: str, n: int, what: str) -> None:
    if not isinstance(value, (list, tuple)):
        raise RolloutError(field, f"must be a list of {what}, got {type(value).__name__}")
    if len(value) != n:
        raise RolloutError(field, f"has {len(value)} entries for {n} response tokens")


def _logprob(value: Any, field: str) -> float:
    x = _number(value, field)
    if x > LOGP_TOL:
        raise RolloutError(field, f"a log-probability must be <= 0, got {x}")
    return min(max(x, LOGP_FLOOR), 0.0)


def _top_row(row: Any, field: str, vocab_size: Optional[int]) -> List[tuple]:
    """One response token's top-k: a non-empty list of distinct ``[token_id, logprob]`` pairs."""
    if not isinstance(row, (list, tuple)) or not row:
        raise RolloutError(field, "must be a non-empty list of [token_id, logprob] pairs")
    if len(row) > MAX_TOP_K:
        raise RolloutError(field, f"has {len(row)} entries, more than {MAX_TOP_K}")
    pairs = []
    for k, pair in enumerate(row):
        where = f"{field}[{k}]"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RolloutError(where, "must be a [token_id, logprob] pair")
        (token,) = _ids([pair[0]], where, vocab_size, 1)
        pairs.append((token, _logprob(pair[1], f"{where}[1]")))
    if len({t for t, _ in pairs}) != len(pairs):
        raise RolloutError(field, "repeats a token id")
    mass = sum(math.exp(x) for _, x in pairs)
    if mass > 1.0 + 1e-3:
        raise RolloutError(field, f"probabilities sum to {mass:.4f} > 1")
    return pairs


def served_fields(meta_info: Mapping[str, Any], num_tokens: int) -> dict:
    """``target_logprobs`` / ``target_top_logprobs`` of a rollout from SGLang's ``/generate`` ``meta_info``
    (request ``return_logprob: true``, ``top_logprobs_num: k``). SGLang gives ``output_token_logprobs`` as
    ``[logprob, token_id, text | null]`` per output token and ``output_top_logprobs`` as a list (per output token,
    ``null`` for an empty row) of such triples; ``text`` is only filled with ``return_text_in_logprobs``. Non-finite
    (JSON ``null``) top-k entries carry no probability and are dropped; a field that does not cover the
    ``num_tokens`` response tokens, or whose sampled-token log-prob is missing, is left out (the learner then
    uses its copy). Log-probs keep 7 significant digits (SGLang computes them in float32; the learner's KD target
    is bfloat16), which keeps a posted rollout ~40 % smaller than Python's 17-digit floats."""
    out: dict = {}
    token = meta_info.get("output_token_logprobs")
    if isinstance(token, list) and len(token) == num_tokens:
        values = [e[0] if isinstance(e, (list, tuple)) and e else None for e in token]
        if all(_finite(v) for v in values):
            out["target_logprobs"] = [_logp7(v) for v in values]
    top = meta_info.get("output_top_logprobs")
    if isinstance(top, list) and len(top) == num_tokens:
        rows = [[[e[1], _logp7(e[0])] for e in row or () if _entry(e)][:MAX_TOP_K] for row in top]
        if all(rows):
            out["target_top_logprobs"] = rows
    return out


def _logp7(x: float) -> float:
    """A served log-prob, at most 0, to 7 significant digits."""
    return min(float(f"{float(x):.7g}"), 0.0)


def _finite(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    value = _as_float(x)
    return value is not None and math.isfinite(value)


def _entry(e: Any) -> bool:
    """An SGLang ``[logprob, token_id, text]`` entry with a finite log-prob and an int id."""
    return isinstance(e, (list, tuple)) and len(e) >= 2 and _finite(e[0]) and isinstance(e[1], int)


def validate_batch(payloads: Any, vocab_size: Optional[int] = None, max_len: int = 32768) -> List[Rollout]:
    if not isinstance(payloads, (list, tuple)):
        raise RolloutError("rollouts", f"must be a list, got {type(payloads).__name__}")
    if not payloads:
        raise RolloutError("rollouts", "must not be empty")
    return [validate_rollout(p, vocab_size, max_len, where=f"rollouts[{i}].") for i, p in enumerate(payloads)]


class ReplayBuffer:
    """Thread-safe FIFO of validated rollouts; the oldest are dropped beyond ``capacity`` rollouts or ``max_entries``
    stored values (:attr:`Rollout.entries`; the newest rollout is always kept)."""

    def __init__(
        self,
        capacity: int = 4096,
        vocab_size: Optional[int] = None,
        max_len: int = 32768,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ):
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.max_entries = max_entries
        self.entries = 0
        self._items: Deque[Rollout] = deque()
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
            self.entries += sum(r.entries for r in rollouts)
            self.total_added += len(rollouts)
            while len(self._items) > 1 and (len(self._items) > self.capacity or self.entries > self.max_entries):
                self.entries -= self._items.popleft().entries
                self.dropped += 1
        return len(rollouts)

    def drain(self) -> List[Rollout]:
        """Take everything (the paper clears the buffer at each update)."""
        with self._lock:
            items, self._items, self.entries = list(self._items), deque(), 0
        return items

    def snapshot(self) -> List[Rollout]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

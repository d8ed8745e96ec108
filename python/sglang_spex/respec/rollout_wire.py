"""Rollouts as one binary body for ``POST /respec/rollouts`` (``Content-Type: application/octet-stream``).

The body is a safetensors file (the tensor format SGLang and transformers already use; no pickle). For N rollouts:

- ``prompt_lens``, ``response_lens``: int32 [N]; ``prompt_ids`` [sum of prompt_lens], ``response_ids`` [sum of
  response_lens]: int32, the rollouts' ids one after another; ``reward``: float64 [N];
- optional ``has_target_logprobs``: uint8 [N] with ``target_logprobs``: float32, one per response token of each
  rollout that has them;
- optional ``has_target_top_logprobs``: uint8 [N] with ``target_top_ids`` (int32) and ``target_top_logprobs``
  (float32), both [response tokens of the rollouts that have them, k]; a row shorter than k is padded with id -1;
- metadata ``{"more": "true"}`` for a part of an RL step whose last part follows.

It holds the same rollouts as the JSON body and is checked by the same rules (``buffer.py``), on whole arrays:
an error names the field as the JSON path does (``rollouts[3].target_top_logprobs[7]``), or the tensor. Decoding
a 4 MiB body takes milliseconds and holds Python's GIL far less than JSON's nested lists do; a top-k cell is
8 bytes instead of ~20 bytes of JSON.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from safetensors.numpy import load, save

from sglang_spex.respec.buffer import (
    ID_DTYPE,
    ID_LIMIT,
    LOGP_DTYPE,
    LOGP_FLOOR,
    LOGP_TOL,
    MAX_TOP_K,
    PAD_ID,
    Rollout,
    RolloutError,
    TopK,
    validate_batch,
)

CONTENT_TYPE = "application/octet-stream"
HEADER_BYTES = 2048  # an upper bound on a body's safetensors header (9 tensors' names, shapes, offsets, metadata)
REQUIRED = ("prompt_lens", "response_lens", "prompt_ids", "response_ids", "reward")
OPTIONAL = (
    "has_target_logprobs",
    "target_logprobs",
    "has_target_top_logprobs",
    "target_top_ids",
    "target_top_logprobs",
)


def encode(rollouts: Sequence[Mapping[str, Any]], more: bool = False) -> bytes:
    """The binary body of ``rollouts``, given as the JSON body's dicts (validated the same way first, so a bad
    rollout raises :class:`RolloutError` here, not at the server; the vocabulary and context are the server's)."""
    return _encode(validate_batch(list(rollouts), max_len=ID_LIMIT), more)


def parts(rollouts: Sequence[Mapping[str, Any]], limit: int) -> List[bytes]:
    """One RL step's ``rollouts`` as binary bodies of at most ``limit`` bytes each, in order, each but the last
    with ``more``; raises ValueError naming a rollout that cannot fit alone."""
    checked = validate_batch(list(rollouts), max_len=ID_LIMIT)
    ranges, start, part = [], 0, (0, 0, 0)  # the current part's (fixed bytes, top-k rows, top-k width)
    for i, r in enumerate(checked):
        own = _value_bytes(r)
        if HEADER_BYTES + _bytes(own) > limit:
            raise ValueError(f"rollout {i} is {_bytes(own)} bytes, over the learner's limit {limit} (max_post_bytes)")
        grown = (part[0] + own[0], part[1] + own[1], max(part[2], own[2]))
        if i > start and HEADER_BYTES + _bytes(grown) > limit:
            ranges.append(range(start, i))
            start, grown = i, own
        part = grown
    ranges.append(range(start, len(checked)))
    return [_encode([checked[i] for i in part], j < len(ranges) - 1) for j, part in enumerate(ranges)]


def _value_bytes(rollout: Rollout) -> Tuple[int, int, int]:
    """(bytes of ``rollout``'s ids, lengths, reward, flags and log-probs; its top-k rows; their width)."""
    n = len(rollout.response_ids)
    fixed = 4 * rollout.num_tokens + 4 + 4 + 8 + 2 + (4 * n if rollout.target_logprobs is not None else 0)
    top = rollout.target_top_logprobs
    return (fixed, n, top.ids.shape[1]) if top is not None else (fixed, 0, 0)


def _bytes(part: Tuple[int, int, int]) -> int:
    """A part's values in bytes: its top-k rows are as wide as its widest (8 bytes a cell: id and log-prob)."""
    fixed, rows, k = part
    return fixed + 8 * rows * k


def _encode(checked: Sequence[Rollout], more: bool) -> bytes:
    arrays: Dict[str, np.ndarray] = {
        "prompt_lens": np.array([len(r.prompt_ids) for r in checked], dtype=np.int32),
        "response_lens": np.array([len(r.response_ids) for r in checked], dtype=np.int32),
        "prompt_ids": np.concatenate([r.prompt_ids for r in checked]),
        "response_ids": np.concatenate([r.response_ids for r in checked]),
        "reward": np.array([r.reward for r in checked], dtype=np.float64),
    }
    with_logp = [r.target_logprobs for r in checked if r.target_logprobs is not None]
    if with_logp:
        arrays["has_target_logprobs"] = np.array([r.target_logprobs is not None for r in checked], dtype=np.uint8)
        arrays["target_logprobs"] = np.concatenate(with_logp)
    with_top = [r.target_top_logprobs for r in checked if r.target_top_logprobs is not None]
    if with_top:
        k = max(t.ids.shape[1] for t in with_top)
        arrays["has_target_top_logprobs"] = np.array(
            [r.target_top_logprobs is not None for r in checked], dtype=np.uint8
        )
        arrays["target_top_ids"] = np.concatenate([_pad(t.ids, k, PAD_ID) for t in with_top])
        arrays["target_top_logprobs"] = np.concatenate([_pad(t.logp, k, 0.0) for t in with_top])
    return save(arrays, metadata={"more": "true" if more else "false"})


def _pad(a: np.ndarray, k: int, fill: Any) -> np.ndarray:
    return a if a.shape[1] == k else np.pad(a, ((0, 0), (0, k - a.shape[1])), constant_values=fill)


def decode(data: bytes, vocab_size: Optional[int] = None, max_len: int = 32768) -> Tuple[List[Rollout], bool]:
    """The rollouts of a binary body and its ``more`` flag; raises :class:`RolloutError` naming the field."""
    try:
        arrays = load(data)
        more = header_metadata(data).get("more", "false")
    except Exception as e:  # whatever the header holds (a dtype numpy lacks, e.g. BF16, is a KeyError)
        raise RolloutError("body", f"must be a safetensors file of rollouts ({type(e).__name__}: {e})") from None
    if more not in ("true", "false"):
        raise RolloutError("more", f'metadata must be "true" or "false", got {more!r}')
    unknown = sorted(set(arrays) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise RolloutError(unknown[0], f"unknown tensor (allowed: {', '.join(REQUIRED + OPTIONAL)})")
    for name in REQUIRED:
        if name not in arrays:
            raise RolloutError(name, "missing")
    reward = _array(arrays, "reward", "fiu", 1).astype(np.float64)
    n = len(reward)
    if n == 0:
        raise RolloutError("rollouts", "must not be empty")
    plens, rlens = (_lens(arrays, name, n, max_len) for name in ("prompt_lens", "response_lens"))
    too_long = np.flatnonzero(plens + rlens > max_len)  # each <= max_len: the sum cannot overflow
    if too_long.size:
        b = int(too_long[0])
        raise RolloutError(
            f"rollouts[{b}].response_ids",
            f"prompt and response have {plens[b] + rlens[b]} tokens, more than the {max_len} a rollout may have",
        )
    prompt = _ids(arrays, "prompt_ids", plens, vocab_size)
    response = _ids(arrays, "response_ids", rlens, vocab_size)
    bad = np.flatnonzero(~np.isfinite(reward))
    if bad.size:
        raise RolloutError(f"rollouts[{bad[0]}].reward", f"must be finite, got {reward[bad[0]]}")
    logp = _per_response(arrays, "target_logprobs", rlens, vocab_size)
    top = _per_response(arrays, "target_top_logprobs", rlens, vocab_size)
    rollouts = [
        Rollout(p, r, float(reward[b]), logp[b] if logp is not None else None, top[b] if top is not None else None)
        for b, (p, r) in enumerate(zip(_split(prompt, plens), _split(response, rlens)))
    ]
    return rollouts, more == "true"


def header_metadata(data: bytes) -> Dict[str, str]:
    """The header's ``__metadata__`` (read after ``load`` has checked the header)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def _array(arrays: Mapping[str, np.ndarray], name: str, kinds: str, ndim: int) -> np.ndarray:
    a = arrays[name]
    if a.dtype.kind not in kinds or a.ndim != ndim:
        want = {"f": "float", "fiu": "number", "iu": "integer", "bu": "uint8 or bool"}[kinds]
        raise RolloutError(name, f"must be a {ndim}-d {want} tensor, got {a.dtype} of shape {list(a.shape)}")
    return a


def _lens(arrays: Mapping[str, np.ndarray], name: str, n: int, max_len: int) -> np.ndarray:
    lens = _array(arrays, name, "iu", 1)
    if len(lens) != n:
        raise RolloutError(name, f"has {len(lens)} entries for {n} rollouts")
    field = name.replace("_lens", "_ids")
    empty = np.flatnonzero(lens < 1)
    if empty.size:
        raise RolloutError(f"rollouts[{empty[0]}].{field}", "must not be empty")
    long = np.flatnonzero(lens > max_len)  # compared before any cast or sum: nothing wraps
    if long.size:
        b = int(long[0])
        raise RolloutError(
            f"rollouts[{b}].{field}", f"has {lens[b]} tokens, more than the {max_len} a rollout may have"
        )
    return lens.astype(np.int64)


def _split(a: np.ndarray, lens: np.ndarray, copy: bool = True) -> List[np.ndarray]:
    """``a``'s rows cut into one part per rollout of ``lens`` rows; copies unless ``copy`` is False (a stored
    rollout holds only its own values, not a view of the whole body)."""
    parts = np.split(a, np.cumsum(lens)[:-1])
    return [p.copy() for p in parts] if copy else parts


def _where(lens: np.ndarray, flat: int) -> Tuple[int, int]:
    """(rollout, index within it) of position ``flat`` of the rollouts' concatenated rows."""
    ends = np.cumsum(lens)
    b = int(np.searchsorted(ends, flat, side="right"))
    return b, int(flat - (ends[b] - lens[b]))


def _ids(arrays: Mapping[str, np.ndarray], name: str, lens: np.ndarray, vocab_size: Optional[int]) -> np.ndarray:
    ids = _array(arrays, name, "iu", 1).astype(np.int64)
    if len(ids) != lens.sum():
        raise RolloutError(name, f"has {len(ids)} ids, the lengths sum to {lens.sum()}")
    _in_vocab(ids, vocab_size, lambda i: _field(name, lens, i))
    return ids.astype(ID_DTYPE)


def _in_vocab(ids: np.ndarray, vocab_size: Optional[int], field_of: Any, low: int = 0) -> None:
    limit = vocab_size if vocab_size is not None else ID_LIMIT
    bad = np.flatnonzero((ids < low) | (ids >= limit))
    if bad.size:
        i = int(bad[0])
        raise RolloutError(field_of(i), f"token id {ids.flat[i]} outside [0, {limit})")


def _per_response(
    arrays: Mapping[str, np.ndarray], name: str, rlens: np.ndarray, vocab_size: Optional[int]
) -> Optional[List[Any]]:
    """Per rollout: its ``target_logprobs`` array or ``TopK`` (None where it has none); None without the field."""
    flag = f"has_{name}"
    values = (name, "target_top_ids") if name == "target_top_logprobs" else (name,)
    present = [v in arrays for v in (flag, *values)]
    if not any(present):
        return None
    if not all(present):
        missing = [v for v, p in zip((flag, *values), present) if not p][0]
        raise RolloutError(missing, f"missing (it comes with {', '.join(v for v in (flag, *values) if v != missing)})")
    has = _array(arrays, flag, "bu", 1).astype(bool)
    if len(has) != len(rlens):
        raise RolloutError(flag, f"has {len(has)} entries for {len(rlens)} rollouts")
    lens = np.where(has, rlens, 0)
    rows = int(lens.sum())
    if name == "target_logprobs":
        logp = _array(arrays, name, "f", 1)
        if logp.shape[0] != rows:
            raise RolloutError(name, f"has {logp.shape[0]} values for the {rows} response tokens of its rollouts")
        logp = _logprobs(logp, np.ones(rows, dtype=bool), lambda i: _field(name, lens, i))
        return [part if h else None for part, h in zip(_split(logp, lens), has)]
    ids = _array(arrays, "target_top_ids", "iu", 2).astype(np.int64)
    logp = _array(arrays, name, "f", 2)
    if ids.shape != logp.shape or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TOP_K:
        raise RolloutError(
            name,
            f"shape {list(logp.shape)} (target_top_ids {list(ids.shape)}): want [{rows} response tokens, k <= "
            f"{MAX_TOP_K}]",
        )
    k = ids.shape[1]

    def row_of(i: int) -> str:  # a flat cell index → its row's field
        return _field(name, lens, i // k)

    _in_vocab(ids, vocab_size, row_of, low=PAD_ID)  # PAD_ID: a cell past the row's end
    cell = ids != PAD_ID
    logp = _logprobs(logp, cell, row_of)
    _rows_valid(ids, np.where(cell, logp, -np.inf), cell, lambda i: _field(name, lens, i))
    return [_top(i, p) if h else None for i, p, h in zip(_split(ids, lens, False), _split(logp, lens, False), has)]


def _top(ids: np.ndarray, logp: np.ndarray) -> TopK:
    """A rollout's rows, as wide as its widest row (not the body's)."""
    k = int(np.flatnonzero((ids != PAD_ID).any(axis=0))[-1]) + 1
    return TopK(ids[:, :k].astype(ID_DTYPE), logp[:, :k].copy())  # copies: not a view of the body's width


def _field(name: str, lens: np.ndarray, row: int) -> str:
    b, i = _where(lens, row)
    return f"rollouts[{b}].{name}[{i}]"


def _logprobs(a: np.ndarray, cell: np.ndarray, field_of: Any) -> np.ndarray:
    """``a`` as stored log-probs (rounding-positive ones are 0); its ``cell`` entries must be finite and <= 0."""
    bad = np.flatnonzero(cell & ~(np.isfinite(a) & (a <= LOGP_TOL)))
    if bad.size:
        i = int(bad[0])
        raise RolloutError(field_of(i), f"a log-probability must be finite and <= 0, got {a.flat[i]}")
    return np.where(cell, np.clip(a, LOGP_FLOOR, 0.0), 0.0).astype(LOGP_DTYPE)


def _rows_valid(ids: np.ndarray, logp: np.ndarray, cell: np.ndarray, field_of: Any) -> None:
    """Every top-k row: at least one entry, no repeated id, probabilities summing to at most 1."""
    empty = np.flatnonzero(~cell.any(axis=1))
    if empty.size:
        raise RolloutError(field_of(int(empty[0])), "must have at least one [token_id, logprob] entry")
    ordered = np.sort(np.where(cell, ids, -1 - np.arange(ids.shape[1])), axis=1)  # padding never repeats
    repeated = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if repeated.size:
        raise RolloutError(field_of(int(repeated[0])), "repeats a token id")
    mass = np.exp(logp.astype(np.float64)).sum(axis=1)
    over = np.flatnonzero(mass > 1.0 + 1e-3)
    if over.size:
        raise RolloutError(field_of(int(over[0])), f"probabilities sum to {mass[over[0]]:.4f} > 1")

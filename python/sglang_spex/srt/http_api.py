"""Request bodies of the plugin's HTTP routes (pydantic models) and their one error shape.

Bad input answers HTTP 400 ``{"error": {"field": <name>, "reason": <why>}}``; nested names are dotted, list
items indexed (``batch_sizes[2]``). Every body rejects unknown fields and takes JSON types as they are (no
``"3"`` for 3). The search ``spec`` inside ``POST /tot/search`` and the ReSpec rollouts keep their own
validators (``tot/search_spec.py``, ``respec/buffer.py``), which name fields the same way. A client that
disconnects before its whole body came gets the same shape with 499 (``field`` ``body``), not a server error.

This module imports only the leaves ``config.py`` and ``tot/validation.py`` of the plugin, so every routes module
can use it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple, Type, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect

from sglang_spex.config import DEFAULT_MAX_BODY_BYTES
from sglang_spex.tot.validation import MAX_JSON_DEPTH, SEARCH_ID_PATTERN, FieldError

STATE_ATTR = "spex"  # the plugin's HTTP-side state lives on ``app.state.spex`` (``srt/http_state.py``)
# the answer to a request whose client went away before its body was read (nginx's "client closed request"; no
# client reads it, and no route logs it as a server error)
CLIENT_CLOSED = 499

B = TypeVar("B", bound="Body")


class BodyError(FieldError):
    """A request body field is invalid; ``field`` names it, ``reason`` says why, ``status_code`` is the HTTP
    answer (400; 413 for a body over the size limit, 409 for a search id in use, 499 for a client that disconnected
    before its body was read)."""

    def __init__(self, field_name: str, reason: str, status_code: int = 400):
        super().__init__(field_name, reason)
        self.status_code = status_code


def error_response(field_name: str, reason: str, status_code: int = 400) -> JSONResponse:
    """The plugin's error answer: ``{"error": {"field", "reason"}}``; text that cannot be UTF-8 (a lone surrogate
    echoed from a request) is escaped, never a 500."""
    error = {"field": _encodable(field_name), "reason": _encodable(reason)}
    return JSONResponse({"error": error}, status_code=status_code)


def _encodable(text: Any) -> Any:
    """``text`` as it is when UTF-8 can encode it; else with its lone surrogates backslash-escaped."""
    if not isinstance(text, str) or text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Body(BaseModel):
    """Base of every request body: unknown fields are errors, values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _field_name(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _error_of(model: Type[Body], e: ValidationError) -> BodyError:
    errors = e.errors()
    unknown = [x for x in errors if x["type"] == "extra_forbidden"]
    first = (unknown or errors)[0]
    if first["type"] == "extra_forbidden":
        reason = f"unknown field; expected one of {sorted(model.model_fields)}"
    elif first["type"] == "model_type":
        reason = "must be a JSON object"
    else:
        reason = first["msg"].removeprefix("Value error, ")
    return BodyError(_field_name(first["loc"]), reason)


def parse_body(model: Type[B], raw: Any) -> B:
    """Validate decoded JSON against ``model``; raises :class:`BodyError` naming the first bad field (an
    unknown field first)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise _error_of(model, e) from None


def body_limit(request: Request) -> int:
    """The largest request body the plugin's routes read (``--tot-max-body-bytes``; its default on an app
    without the plugin's state)."""
    state = getattr(request.app.state, STATE_ATTR, None)
    return state.cfg.max_body_bytes if state is not None else DEFAULT_MAX_BODY_BYTES


async def read_body(request: Request, limit: Optional[int], setting: str = "--tot-max-body-bytes") -> bytes:
    """The raw body, read in chunks and refused (413) as soon as it passes ``limit`` bytes (None: no limit);
    ``setting`` names what sets the limit in the error. A client that disconnects before the whole body came is
    a :class:`BodyError` too (``CLIENT_CLOSED``), so the route ends quietly instead of with a traceback."""
    try:
        if limit is None:
            return await request.body()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyError("body", f"{declared} bytes is over this server's limit {limit} ({setting})", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyError("body", f"over this server's limit {limit} bytes ({setting})", 413)
            chunks.append(chunk)
        return b"".join(chunks)
    except ClientDisconnect:
        raise BodyError("body", "the client disconnected before the whole body was sent", CLIENT_CLOSED) from None


async def read_json(
    request: Request, optional: bool = False, limit: Any = "server", setting: str = "--tot-max-body-bytes"
) -> Any:
    """The request's JSON (``{}`` for an empty body when ``optional``); raises :class:`BodyError` on bad JSON,
    nesting too deep to decode, or a body over ``limit`` bytes (``"server"``: ``--tot-max-body-bytes``; None: no
    limit, for admin-scoped weight uploads; a number: the limit ``setting`` names)."""
    return decode_json(await read_body(request, body_limit(request) if limit == "server" else limit, setting), optional)


def query_number(text: Any, name: str, kind: type = int, default: Any = None) -> Any:
    """A query parameter as ``kind`` (an int64, or a finite float), ``default`` when absent; :class:`BodyError`
    naming ``name`` otherwise (FastAPI's own check would answer in its shape, not the plugin's)."""
    if text is None:
        return default
    text = str(text)  # (a caller in process may pass the number itself)
    try:
        value = kind(text.strip()) if len(text) <= 32 else None
    except ValueError:
        value = None
    ok = value is not None and (math.isfinite(value) if kind is float else abs(value) < 2**63)
    if not ok:
        what = "an integer" if kind is int else "a finite number"
        raise BodyError(
            name, f"{text[:40]!r}: must be {what}" + (" of at most 32 characters" if len(text) > 32 else "")
        )
    return value


def decode_json(data: bytes, optional: bool = False) -> Any:
    """A body's JSON (``{}`` for an empty one when ``optional``); raises :class:`BodyError` on bad JSON, nesting
    deeper than ``MAX_JSON_DEPTH``, or a string or key holding a lone UTF-16 surrogate."""
    if optional and not data.strip():
        return {}
    try:
        value = json.loads(data, object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        raise BodyError(e.key[:100], "given twice in one JSON object (which one counts is ambiguous)") from None
    except json.JSONDecodeError as e:
        raise BodyError("body", f"invalid JSON: {e}"[:300]) from None
    except RecursionError:
        raise BodyError("body", f"JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # a JSON integer past Python's digit limit
        raise BodyError("body", f"a number out of range: {e}"[:300]) from None
    if not _plain(data):
        _check_decoded(value)
    return value


# a UTF-16 surrogate escape (``\ud800``-``\udfff``), or one encoded raw in "UTF-8" (which ``json.loads`` takes)
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _plain(data: bytes) -> bool:
    """A cheap test on the raw body: True when it can hold neither nesting past ``MAX_JSON_DEPTH`` (it has no more
    brackets) nor a lone surrogate (UTF-8 without a surrogate escape); a body that fails it is walked."""
    few_brackets = data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH
    return few_brackets and json.detect_encoding(data) == "utf-8" and _SURROGATE_HINT.search(data) is None


def _check_decoded(value: Any) -> None:
    """Raise :class:`BodyError` (``body``) for decoded JSON nested past ``MAX_JSON_DEPTH``, or with a string or key
    holding a lone surrogate (no text a model or a tokenizer takes, and no UTF-8 to answer it in: it would fail
    deep inside a search, or its answer, as a 500). Iterative: any depth ``json.loads`` decoded."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
            continue
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise BodyError("body", f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k)
                if isinstance(x, (str, list, dict)):
                    stack.append((x, depth))
        else:  # a list (numbers, booleans and null need no check)
            stack.extend([(x, depth) for x in v if isinstance(x, (str, list, dict))])


def _check_text(text: str) -> None:
    if not text.isascii() and _LONE_SURROGATE.search(text):
        raise BodyError("body", "invalid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) in a string or key")


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: Set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k)
            seen.add(k)
    return out


def json_body(
    model: Type[B], optional: bool = False
) -> Callable[[Callable[[Request, B], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]]:
    """Decorate ``handler(request, body)`` into a FastAPI endpoint that parses ``model`` first and answers a
    bad body with :func:`error_response` (400) without calling the handler."""

    def wrap(handler: Callable[[Request, B], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                body = parse_body(model, await read_json(request, optional))
            except BodyError as e:
                return error_response(e.field, e.reason, e.status_code)
            return await handler(request, body)

        endpoint.__name__ = handler.__name__
        endpoint.__doc__ = handler.__doc__
        return endpoint

    return wrap


# ---------------------------------------------------------------- /tot/search
class SearchBody(Body):
    """``POST /tot/search``; ``spec`` is validated afterwards by ``SearchSpec.from_dict``."""

    spec: Dict[str, Any] = Field(default_factory=dict)
    question: str = Field(min_length=1)
    reference: Optional[str] = None
    stream: bool = False
    search_id: Optional[str] = Field(default=None, pattern=SEARCH_ID_PATTERN)

    @field_validator("question")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty string")
        return v

    @field_validator("reference", mode="before")
    @classmethod
    def _reference(cls, v: Any) -> Optional[str]:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ValueError("must be a string or a number")
        return str(v)


# ---------------------------------------------------------------- /spex/* control
COUNT_MAX = 2**31 - 1  # the largest request count (budget, knee) a body may give: past any batch, and a float exactly
# a search id, rid or rid prefix a control body may name (the scheduler keeps cancelled and protected ids for
# minutes: an unbounded one would be memory a client keeps there)
ID_MAX_CHARS = 256
PROTECT_TTL_MAX_S = 3600.0  # a protection lease past an hour would outlive any search it is for
# protection may lock at most this share of the KV pool: the rest stays for admission (and protection yields to a
# waiting request that nothing else would make room for, srt/prefix_protection.py)
PROTECT_FRACTION_MAX = 0.9


class BudgetBody(Body):
    """``POST /spex/budget``: speculative admission cap ``k`` (null = unlimited)."""

    k: Optional[int] = Field(ge=0, le=COUNT_MAX)


class CancelBody(Body):
    """``POST /spex/cancel``: a whole search, or any rid prefix (one of the two)."""

    search_id: str = Field(default="", max_length=ID_MAX_CHARS)
    rid_prefix: str = Field(default="", max_length=ID_MAX_CHARS)

    @model_validator(mode="after")
    def _one(self) -> "CancelBody":
        if bool(self.search_id) == bool(self.rid_prefix):
            raise ValueError("give one of search_id and rid_prefix")
        return self


class PromoteBody(Body):
    """``POST /spex/promote``: the request (rid) a search now waits on; ``ack`` false: answer once the command is
    queued to the scheduler (in order with this process's generate requests) instead of after it was applied."""

    rid: str = Field(min_length=1, max_length=ID_MAX_CHARS)
    ack: bool = True


class ProtectBody(Body):
    """``POST /spex/protect``: register a live search / renew its protection lease."""

    search_id: str = Field(min_length=1, max_length=ID_MAX_CHARS)


class ReleaseBody(Body):
    """``POST /spex/release``: one search's protection (or a subtree's); no ``search_id`` field = every search's
    (an empty one is refused: it is not "all")."""

    search_id: str = Field(default="", min_length=1, max_length=ID_MAX_CHARS)  # the default is not validated
    node_prefix: str = Field(default="", max_length=ID_MAX_CHARS)

    @model_validator(mode="after")
    def _prefix_needs_search(self) -> "ReleaseBody":
        if self.node_prefix and not self.search_id:
            raise ValueError("node_prefix needs search_id")
        return self


class KnobsBody(Body):
    """``POST /spex/knobs``: at least one of the scheduler-side knobs."""

    immediate_cancel: Optional[bool] = None
    protect_ttl_s: Optional[float] = Field(default=None, ge=0, le=PROTECT_TTL_MAX_S, allow_inf_nan=False)
    protect_max_fraction: Optional[float] = Field(default=None, ge=0, le=PROTECT_FRACTION_MAX, allow_inf_nan=False)
    knee: Optional[int] = Field(default=None, ge=-1, le=COUNT_MAX)  # the gate's given knee; -1 = none
    live_knee: Optional[bool] = None  # also keep speculation below the knee fitted from live decode steps
    spec_prefill_share: Optional[float] = Field(default=None, ge=0, le=1, allow_inf_nan=False)  # prefill allowance

    @field_validator("knee")
    @classmethod
    def _knee_known_or_none(cls, v: Optional[int]) -> Optional[int]:
        if v == 0:
            raise ValueError("must be -1 (no knee) or >= 1")
        return v

    @model_validator(mode="after")
    def _some(self) -> "KnobsBody":
        if not self.values():
            raise ValueError(f"give one of {sorted(type(self).model_fields)}")
        return self

    def values(self) -> Dict[str, float]:
        """The knobs given (not null), as the floats the control message carries."""
        return {k: float(v) for k, v in self.model_dump(exclude_none=True).items()}


# ---------------------------------------------------------------- /spex/profile
class ProfileBody(Body):
    """``POST /spex/profile`` (body optional): measure settings (``ProfileSpec`` fields) and ``force``."""

    batch_sizes: Optional[List[Annotated[int, Field(ge=1)]]] = Field(default=None, min_length=1, max_length=16)
    short_tokens: Optional[int] = Field(default=None, ge=1)
    long_tokens: Optional[int] = Field(default=None, ge=1)
    ctx_prefix_words: Optional[int] = Field(default=None, ge=0)
    ctx_batch: Optional[int] = Field(default=None, ge=1)
    prefill_words: Optional[int] = Field(default=None, ge=0)
    repeats: Optional[int] = Field(default=None, ge=1, le=8)
    force: bool = True

    @field_validator("batch_sizes")
    @classmethod
    def _a_curve(cls, v: Optional[List[int]]) -> Optional[List[int]]:
        if v is not None and len(set(v)) < 2:
            raise ValueError("needs at least two different batch sizes (a profile is a step-time curve)")
        return v

    def spec_fields(self) -> Dict[str, Any]:
        """The measure settings given (for ``ProfileSpec(**...)``); empty = keep the current spec."""
        out = self.model_dump(exclude_none=True, exclude={"force"})
        if "batch_sizes" in out:
            out["batch_sizes"] = tuple(out["batch_sizes"])
        return out


# ---------------------------------------------------------------- /respec/*
class RolloutsBody(Body):
    """``POST /respec/rollouts``; each rollout is validated by the learner's buffer. ``more``: more parts of this
    RL step follow (stored, no step counted); the step's last part leaves it false."""

    rollouts: List[Any]
    more: bool = False


# a policy or drafter version: a count of updates (what a Prometheus gauge or an int64 column can hold)
Version = Annotated[int, Field(ge=0, le=2**63 - 1)]


class PolicyBody(Body):
    """``POST /respec/policy``: the payload of ``HotSwapClient`` (one base64 blob)."""

    version: Version
    serialized_named_tensors: List[str] = Field(min_length=1, max_length=1)

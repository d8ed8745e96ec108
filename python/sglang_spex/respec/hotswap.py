"""Push a new drafter version into a running SGLang 0.5.23 server through its weight-update path.

Sequence (``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``):

0. ``POST /pause_generation``  ``{"mode": "in_place"}`` (``pause_in_place=True``, the default): the scheduler stops
   between two forward passes and keeps every running request and its KV cache. Without it, the tokenizer
   manager's ``update_weights_from_tensor`` takes the model-update *writer* lock, i.e. waits until every in-flight
   request has finished and holds back new ones meanwhile — no swap mid-request, and a stall;
1. ``POST /begin_weight_update``  ``{"selector": "draft"}``
2. ``POST /update_weights_from_tensor``  ``{"serialized_named_tensors": [b64 per TP rank], "selector": "draft",
   "weight_version": "respec-<v>", "flush_cache": false, "load_format": null}`` — every tensor in *one* call:
   the scheduler applies it between two forward passes, so no request sees a half-updated (torn) drafter;
3. ``POST /end_weight_update``  ``{}`` — always sent once step 1 succeeded, even if step 2 failed;
4. ``POST /continue_generation``  ``{}`` — always sent once step 0 ran: paused requests resume with the new drafter
   (their tokens are still the target's greedy/verified ones; only acceptance changes).

The payload is what ``MultiprocessingSerializer.deserialize`` (SGLang's ``SafeUnpickler``) reads, but pickled
*by value* with the standard pickler (storages as ``torch.storage._load_from_bytes``, which SGLang maps to its
safe loader) rather than with ``ForkingPickler``: a CPU tensor through ``ForkingPickler`` travels as a shared
file descriptor that only processes with the sender's multiprocessing authkey can fetch. The draft model's
``load_weights`` receives our checkpoint names. The embedding (shared with the target) and d2t/t2d are never sent.
``flush_cache`` stays off: the target's KV/radix cache is unaffected by a draft update.
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import httpx
import torch

WEIGHT_VERSION_PREFIX = "respec-"


class HotSwapError(RuntimeError):
    """A step of the weight-update session failed; ``step`` names it."""

    def __init__(self, step: str, message: str):
        super().__init__(f"{step}: {message}")
        self.step = step


def serialize_named_tensors(named: Sequence[Tuple[str, torch.Tensor]], tp_size: int = 1) -> List[str]:
    """One base64 payload per TP rank (each rank gets the full draft weights: the drafter runs unsharded)."""
    payload = [(n, t.detach().cpu().contiguous().clone()) for n, t in named]
    data = base64.b64encode(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    return [data] * tp_size


def deserialize_named_tensors(data: str) -> List[Tuple[str, torch.Tensor]]:
    """The inverse of one rank's payload, through SGLang's safe unpickler (never plain ``pickle.loads``)."""
    from sglang.srt.utils import MultiprocessingSerializer

    named = MultiprocessingSerializer.deserialize(data)
    if not isinstance(named, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in named
    ):
        raise ValueError("payload must be a list of (name, tensor) pairs")
    return named


def _default_post(timeout: float, api_key: Optional[str] = None) -> Callable[..., Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    def post(url: str, json: dict) -> httpx.Response:
        return httpx.post(url, json=json, timeout=timeout, headers=headers)

    return post


class HotSwapClient:
    """``push(version, named_tensors)`` runs the begin/update/end session against ``base_url``.

    The defaults swap the drafter. The policy itself (``selector="target"``, ``flush_cache=True``: cached KV of
    the old weights is stale) goes through the same session, e.g. from the GRPO loop between two steps."""

    def __init__(
        self,
        base_url: str,
        tp_size: int = 1,
        post: Optional[Callable[..., Any]] = None,
        timeout=120.0,
        pause_in_place: bool = True,
        selector: str = "draft",
        flush_cache: bool = False,
        version_prefix: str = WEIGHT_VERSION_PREFIX,
        begin_retries: int = 0,
        retry_sleep: float = 0.25,
        api_key: Optional[str] = None,
    ):
        """``api_key``: the server's admin key (or its API key without one): SGLang's weight-update routes are
        admin-scoped."""
        if selector not in ("draft", "target", "all"):
            raise ValueError(f"selector must be draft, target or all, got {selector!r}")
        self.base_url = base_url.rstrip("/")
        self.tp_size = tp_size
        self.pause_in_place = pause_in_place
        self.selector = selector
        self.flush_cache = flush_cache
        self.version_prefix = version_prefix
        self.begin_retries = begin_retries
        self.retry_sleep = retry_sleep
        self._post = post or _default_post(timeout, api_key)
        self.pushed_versions: List[int] = []

    def _call(self, step: str, path: str, body: dict) -> dict:
        resp = self._post(f"{self.base_url}{path}", json=body)
        try:
            data = resp.json()
        except Exception:
            data = {"success": False, "message": getattr(resp, "text", "")}
        ok = data.get("success", False) or data.get("status") == "ok"  # pause/continue answer {"status": "ok"}
        if resp.status_code != 200 or not ok:
            raise HotSwapError(step, f"HTTP {resp.status_code}: {data.get('message', data)}")
        return data

    def push(self, version: int, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        body = {
            "serialized_named_tensors": serialize_named_tensors(named, self.tp_size),
            "load_format": None,
            "flush_cache": self.flush_cache,
            "abort_all_requests": False,
            "weight_version": f"{self.version_prefix}{version}",
            "selector": self.selector,
        }
        if self.pause_in_place:
            self._call("pause_generation", "/pause_generation", {"mode": "in_place"})
        try:
            self._session(body)
        finally:
            if self.pause_in_place:
                self._call("continue_generation", "/continue_generation", {})
        self.pushed_versions.append(version)

    def _begin(self) -> None:
        """Open the session; another writer's open session (e.g. the learner's drafter push while the RL loop
        pushes the policy) is waited out for up to ``begin_retries`` × ``retry_sleep`` seconds."""
        for attempt in range(self.begin_retries + 1):
            try:
                self._call("begin_weight_update", "/begin_weight_update", {"selector": self.selector})
                return
            except HotSwapError:
                if attempt == self.begin_retries:
                    raise
                time.sleep(self.retry_sleep)

    def _session(self, body: dict) -> None:
        self._begin()
        try:
            self._call("update_weights_from_tensor", "/update_weights_from_tensor", body)
        finally:
            self._call("end_weight_update", "/end_weight_update", {})

    __call__ = push

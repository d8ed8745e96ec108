"""Push a new drafter version into a running SGLang 0.5.23 server through its weight-update path.

Sequence (``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``):

0. ``POST /pause_generation``  ``{"mode": "in_place"}`` (``pause_in_place=True``, the default): the scheduler stops
   between two forward passes and keeps every running request and its KV cache. Without it, the tokenizer
   manager's ``update_weights_from_tensor`` takes the model-update *writer* lock, i.e. waits until every in-flight
   request has finished and holds back new ones meanwhile — no swap mid-request, and a stall. Skipped when
   generation is paused already (``GET /ready`` answers 503): that pause is someone else's, and the push neither
   takes it again nor releases it. (``/ready`` is also 503 while the server is starting, unhealthy or shutting
   down: the push then runs unpaused, under the writer lock. SGLang keeps one pause flag for every writer, so two
   writers that pause can still release each other's pause: a second writer that saw this push's pause and did
   not pause may run its update unpaused once this push, refused, releases it);
1. ``POST /begin_weight_update``  ``{"selector": "draft"}``. Refused while another writer's session is open (e.g.
   the RL trainer's policy push): the push releases its own pause (step 4), sleeps ``retry_sleep`` and starts again
   at step 0, up to ``begin_retries`` times — generation runs while it waits. (Holding the pause instead froze every
   request for the whole wait, and an unpaused writer waiting on the writer lock behind those frozen requests never
   got to close its session);
2. ``POST /update_weights_from_tensor``  ``{"serialized_named_tensors": [b64 per TP rank], "selector": "draft",
   "weight_version": null, "flush_cache": false, "load_format": null}`` — every tensor in *one* call:
   the scheduler applies it between two forward passes, so no request sees a half-updated (torn) drafter;
3. ``POST /end_weight_update``  ``{}`` — always sent once step 1 succeeded, even if step 2 failed;
4. ``POST /continue_generation``  ``{}`` — always sent once step 0 ran: paused requests resume with the new drafter
   (their tokens are still the target's greedy/verified ones; only acceptance changes);
5. drafter pushes only: ``POST /respec/drafter`` ``{"version": v}`` records the drafter version on the replica
   (``GET /respec/drafter``, ``/spex/info`` → ``drafter_version``). SGLang's ``weight_version`` stays the policy's:
   a drafter push sends none (``tag_weight_version=True`` brings back ``respec-<v>`` there). A server without the
   plugin answers 404 there: the push still counts, the version is just not readable on it.

Replicas: SGLang 0.5.23 refuses ``update_weights_from_tensor`` under ``--dp-size`` > 1 (an assertion in
``TokenizerManager.update_weights_from_tensor``); for a drafter push to such a server (``dp_size`` read once from
``GET /get_server_info``) step 2 goes to the plugin's ``POST /respec/drafter/update_weights_from_tensor`` instead,
which sends the same message to every rank (``srt/dp_drafter_update.py``, touch point W6). Several servers are
several replicas: :class:`ReplicaPublisher` pushes each version to every URL of a list and reports per replica.

The payload is what ``MultiprocessingSerializer.deserialize`` (SGLang's ``SafeUnpickler``) reads, but pickled
*by value* with the standard pickler (storages as ``torch.storage._load_from_bytes``, which SGLang maps to its
safe loader) rather than with ``ForkingPickler``: a CPU tensor through ``ForkingPickler`` travels as a shared
file descriptor that only processes with the sender's multiprocessing authkey can fetch. The draft model's
``load_weights`` receives our checkpoint names. The embedding (shared with the target) and d2t/t2d are never sent.
``flush_cache`` stays off: the target's KV/radix cache is unaffected by a draft update.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures as cf
import io
import pickle
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import httpx
import torch

WEIGHT_VERSION_PREFIX = "respec-"
DP_DRAFTER_PATH = "/respec/drafter/update_weights_from_tensor"  # the plugin's drafter push to every DP rank


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


# The only globals a payload of :func:`serialize_named_tensors` names (a pickle of CPU tensors). SGLang's safe
# unpickler also lets a payload call e.g. ``bytearray`` or ``itertools.repeat``: a 64-byte payload could allocate
# gigabytes before any check ran, so a payload naming anything else is refused before it is unpickled.
PAYLOAD_GLOBALS = frozenset(
    {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")}
)


class _DryUnpickler(pickle.Unpickler):
    """Walks a payload without building anything: an allowed global is a no-op stand-in, any other is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PAYLOAD_GLOBALS:
            raise pickle.UnpicklingError(f"payload names {module}.{name}: only tensors are accepted")
        return _stand_in


def _stand_in(*args: Any, **kwargs: Any) -> dict:
    return {}


def deserialize_named_tensors(data: str) -> List[Tuple[str, torch.Tensor]]:
    """The inverse of one rank's payload: first walked without building anything (:data:`PAYLOAD_GLOBALS` only),
    then through SGLang's safe unpickler (never plain ``pickle.loads``); each tensor must be a plain dense one (a
    view with a zero or overlapping stride could claim a size its storage does not hold)."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:
        _DryUnpickler(io.BytesIO(base64.b64decode(data, validate=True))).load()
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"payload is not base64: {e}") from None
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # truncated, or opcodes the stand-ins cannot follow: not a payload of tensors
        raise pickle.UnpicklingError(f"payload is not a pickle of tensors ({type(e).__name__}: {e})") from None
    named = MultiprocessingSerializer.deserialize(data)
    if not isinstance(named, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in named
    ):
        raise ValueError("payload must be a list of (name, tensor) pairs")
    for name, t in named:
        if not t.is_contiguous() or t.untyped_storage().nbytes() < t.numel() * t.element_size():
            raise ValueError(f"{name}: not a dense tensor (a strided view larger than its storage)")
    return named


def check_weights(named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Raise ``ValueError`` naming the first tensor that is not floating point or holds NaN/inf: such a push would
    load (SGLang casts and copies) and leave a drafter that never proposes a token the target accepts."""
    for name, tensor in named:
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}: holds NaN or infinite values")


def _auth(api_key: Optional[str]) -> Optional[Dict[str, str]]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def _default_post(timeout: float, api_key: Optional[str] = None) -> Callable[..., Any]:
    def post(url: str, json: dict) -> httpx.Response:
        return httpx.post(url, json=json, timeout=timeout, headers=_auth(api_key))

    return post


def _default_get(timeout: float, api_key: Optional[str] = None) -> Callable[..., Any]:
    def get(url: str) -> httpx.Response:
        return httpx.get(url, timeout=timeout, headers=_auth(api_key))

    return get


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
        tag_weight_version: Optional[bool] = None,
        get: Optional[Callable[..., Any]] = None,
    ):
        """``api_key``: the server's admin key (or its API key without one): SGLang's weight-update routes are
        admin-scoped. ``tag_weight_version``: send ``<version_prefix><version>`` as SGLang's ``weight_version``
        (default: for the policy, ``selector`` target/all, not for the drafter, whose version goes to
        ``/respec/drafter`` instead). ``post``/``get``: the HTTP calls (httpx by default); with ``post`` given and no
        ``get``, the server is taken to run one DP rank."""
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
        self.tag_weight_version = selector != "draft" if tag_weight_version is None else tag_weight_version
        self._post = post or _default_post(timeout, api_key)
        self._get = get or (None if post else _default_get(timeout, api_key))
        self.pushed_versions: List[int] = []
        self.version_recorded: Optional[bool] = None  # the last drafter push's version reached /respec/drafter
        self.dp_size: Optional[int] = None  # the server's --dp-size, read on the first drafter push

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
        """Run the session; raises :class:`HotSwapError` naming the failed step (the replica then keeps the
        weights it had unless the update step itself failed part-way, see :class:`ReplicaPublisher`). Drafter weights
        that are not floating point or not finite fail step ``check`` before anything is sent."""
        if self.selector == "draft":
            try:
                check_weights(named)
            except ValueError as e:
                raise HotSwapError("check", str(e)) from None
        body = {
            "serialized_named_tensors": serialize_named_tensors(named, self.tp_size),
            "load_format": None,
            "flush_cache": self.flush_cache,
            "abort_all_requests": False,
            "weight_version": f"{self.version_prefix}{version}" if self.tag_weight_version else None,
            "selector": self.selector,
        }
        for attempt in range(self.begin_retries + 1):
            own_pause = self.pause_in_place and not self._engine_paused()
            if own_pause:
                self._call("pause_generation", "/pause_generation", {"mode": "in_place"})
            try:
                opened = self._session(body, last_try=attempt == self.begin_retries)
            finally:
                if own_pause:  # also when another writer's session is open: generation runs while we wait
                    self._call("continue_generation", "/continue_generation", {})
            if opened:
                break
            time.sleep(self.retry_sleep)
        self.pushed_versions.append(version)
        if self.selector == "draft":
            self.version_recorded = self._record_version(version)

    def _record_version(self, version: int) -> bool:
        """``POST /respec/drafter``; False (never an error: the weights did land) when the replica cannot record."""
        try:
            resp = self._post(f"{self.base_url}/respec/drafter", json={"version": version})
            return resp.status_code == 200
        except Exception:
            return False

    def _engine_paused(self) -> bool:
        """Whether generation is paused already (SGLang's ``GET /ready`` answers 503 while it is): someone else's
        pause, which a push then neither takes again nor releases. False when this client cannot GET."""
        if self._get is None:
            return False
        try:
            return self._get(f"{self.base_url}/ready").status_code == 503
        except Exception:
            return False

    def _server_dp_size(self) -> int:
        """The server's ``dp_size`` (``GET /get_server_info``; 1 when it does not say)."""
        if self.dp_size is None:
            if self._get is None:
                self.dp_size = 1
            else:
                resp = self._get(f"{self.base_url}/get_server_info")
                self.dp_size = int(resp.json().get("dp_size") or 1) if resp.status_code == 200 else 1
        return self.dp_size

    def _session(self, body: dict, last_try: bool = True) -> bool:
        """Open, update, close; False (nothing sent past the open) when another writer's session is open and this is
        not ``last_try``, whose refusal raises."""
        path = "/update_weights_from_tensor"
        if self.selector == "draft" and self._server_dp_size() > 1:  # SGLang's route asserts dp_size == 1
            path = DP_DRAFTER_PATH
            body = {k: body[k] for k in ("serialized_named_tensors", "load_format")}
        try:
            self._call("begin_weight_update", "/begin_weight_update", {"selector": self.selector})
        except HotSwapError:
            if last_try:
                raise
            return False
        try:
            self._call("update_weights_from_tensor", path, body)
        finally:
            self._call("end_weight_update", "/end_weight_update", {})
        return True

    __call__ = push


@dataclass
class ReplicaResult:
    """One replica's outcome of one publish."""

    url: str
    ok: bool
    version: Optional[int]  # the drafter version it serves now as far as this publisher knows (None: its own)
    step: str = ""  # the failed step ("" on success); "connect" for a replica that could not be reached
    error: str = ""
    restored: Optional[bool] = None  # the update step failed: True if its previous version was pushed back
    version_recorded: Optional[bool] = None  # its /respec/drafter took the version (False: not readable there)


class ReplicaPublishError(RuntimeError):
    """No replica took the version; ``results`` has each one's outcome (every replica keeps its drafter)."""

    def __init__(self, version: int, results: List[ReplicaResult]):
        failed = "; ".join(f"{r.url}: {r.step}: {r.error}" for r in results)
        super().__init__(f"drafter version {version} reached no replica ({failed})")
        self.results = results
        self.restored = True  # each replica was handled here: the caller must not push the old version again


class ReplicaPublisher:
    """One learner feeding several replicas: ``publish(version, named)`` pushes the version to every replica at
    once (one :class:`HotSwapClient` each) and returns ``{"version", "replicas": [ReplicaResult...], "failed"}``.

    A replica that fails keeps its old drafter: a failure before the update step changed nothing there; a failed
    update step is followed by a push of the version it served before (when this publisher pushed it; a replica
    still on its start-up drafter cannot be restored this way, ``restored`` says which). The failed replica stays
    on its old version and takes the next one with the others (every push carries the whole drafter). If no
    replica took the version, :class:`ReplicaPublishError` is raised (the learner then rolls the update back)."""

    def __init__(
        self,
        urls: Sequence[str] = (),
        clients: Sequence[HotSwapClient] = (),
        **client_kw: Any,
    ):
        """``urls`` (each gets ``HotSwapClient(url, **client_kw)``) and/or ready ``clients``."""
        self.clients: List[HotSwapClient] = [*clients, *(HotSwapClient(u, **client_kw) for u in urls)]
        if not self.clients:
            raise ValueError("a ReplicaPublisher needs at least one replica")
        self.versions: Dict[str, Optional[int]] = {c.base_url: None for c in self.clients}
        self.last: Dict[str, ReplicaResult] = {}
        self._weights: Dict[int, List[Tuple[str, torch.Tensor]]] = {}  # versions some replica still serves

    def _push_one(self, client: HotSwapClient, version: int, named: List[Tuple[str, torch.Tensor]]) -> ReplicaResult:
        url, before = client.base_url, self.versions[client.base_url]
        try:
            client.push(version, named)
            return ReplicaResult(url, True, version, version_recorded=client.version_recorded)
        except HotSwapError as e:
            res = ReplicaResult(url, False, before, e.step, str(e))
        except Exception as e:  # down, refused, timed out
            return ReplicaResult(url, False, before, "connect", f"{type(e).__name__}: {e}")
        if res.step == "update_weights_from_tensor":  # may have loaded part of the tensors: put `before` back
            res.restored = False
            if before is not None and before in self._weights:
                try:
                    client.push(before, self._weights[before])
                    res.restored = True
                except Exception as e:
                    res.error += f"; restore failed: {e}"
        return res

    def publish(self, version: int, named: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, Any]:
        tensors = [(n, t.detach().cpu().clone()) for n, t in named]
        with cf.ThreadPoolExecutor(len(self.clients)) as ex:
            results = list(ex.map(lambda c: self._push_one(c, version, tensors), self.clients))
        for r in results:
            self.versions[r.url] = r.version
            self.last[r.url] = r
        self._weights[version] = tensors
        served = set(self.versions.values())
        self._weights = {v: w for v, w in self._weights.items() if v in served}
        if not any(r.ok for r in results):
            raise ReplicaPublishError(version, results)
        return {"version": version, "replicas": [asdict(r) for r in results],
                "failed": [r.url for r in results if not r.ok]}  # fmt: skip

    __call__ = publish

    def status(self) -> List[Dict[str, Any]]:
        """Each replica: the drafter version it serves as far as this publisher knows, and its last outcome."""
        return [{"url": c.base_url, "version": self.versions[c.base_url],
                 "last": asdict(self.last[c.base_url]) if c.base_url in self.last else None}
                for c in self.clients]  # fmt: skip

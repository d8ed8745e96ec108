"""The narrow interface the search uses to reach an engine: generate one node, abort requests.

Three implementations share it, so no search code is duplicated:
- :class:`sglang_spex.srt.engine_port.TokenizerManagerPort` — inside the SGLang server process
  (server-side search), through SGLang's own request path;
- :class:`sglang_spex.tot.http_port.HttpPort` — any SGLang HTTP endpoint (client-side search);
- the simulator's port (``sglang_spex.sim``).

Request identity conventions (read by the scheduler hooks in ``srt/``):
- ``rid = f"spex:{search_id}:{path}:"`` for a primary request, ``f"spex:{search_id}:{path}:s"`` for a
  speculative one, where ``path`` is the node path as dot-separated child indices (root = ``"r"``, e.g.
  ``"r.0.2"``). SGLang aborts by rid *prefix*, so ``spex:{search_id}:`` names a whole search,
  ``spex:{search_id}:r.0:`` one node (either role) and ``spex:{search_id}:r.0.`` a subtree.
- ``custom_params = {"spex_role": "primary"|"spec", "spex_search": search_id, "spex_node": path}``; where a proxy
  drops ``custom_params`` (sglang-router rebuilds the body), the scheduler reads the role from the rid. A
  speculative request may add ``"spex_worth_s"``: the seconds its expected hit saves its search, which the
  scheduler weighs against what its prefill costs the primaries (``srt/prefill_allowance.py``), and
  ``"spex_sure": true`` when its search expects to use it (the speculative gate lets it run above the knee).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

ROLE_PRIMARY = "primary"
ROLE_SPEC = "spec"
RID_PREFIX = "spex"


def search_rid_prefix(search_id: str) -> str:
    return f"{RID_PREFIX}:{search_id}:"


SPEC_RID_SUFFIX = "s"


def node_rid(search_id: str, path: str, role: str = ROLE_PRIMARY) -> str:
    return f"{RID_PREFIX}:{search_id}:{path}:{SPEC_RID_SUFFIX if role == ROLE_SPEC else ''}"


def parse_rid(rid: str) -> Optional[Tuple[str, str, str]]:
    """(search_id, path, role) for a sglang-spex rid, else None."""
    parts = rid.split(":")
    if len(parts) != 4 or parts[0] != RID_PREFIX or parts[3] not in ("", SPEC_RID_SUFFIX):
        return None
    return parts[1], parts[2], ROLE_SPEC if parts[3] == SPEC_RID_SUFFIX else ROLE_PRIMARY


@dataclass
class GenRequest:
    """One node expansion: continue ``prompt`` (text) by one reasoning step."""

    prompt: str
    rid: str
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: List[str] = field(default_factory=list)
    seed: Optional[int] = None
    return_logprob: bool = False
    role: str = ROLE_PRIMARY
    search_id: str = ""
    node_path: str = ""
    priority: Optional[int] = None
    dp_rank: Optional[int] = None  # SGLang's routed_dp_rank: every request of a search on one DP rank
    worth_s: Optional[float] = None  # speculative: seconds its expected hit saves the search (the prefill allowance)
    search_priority: Optional[int] = None  # speculative: its search's primary priority (it ranks below that too)
    sure: bool = False  # speculative: its search expects to use it (the gate lets it run above the knee)

    def sampling_params(self) -> Dict[str, Any]:
        sp: Dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "custom_params": {"spex_role": self.role, "spex_search": self.search_id, "spex_node": self.node_path},
        }
        if self.worth_s is not None:
            sp["custom_params"]["spex_worth_s"] = float(self.worth_s)
        if self.sure:
            sp["custom_params"]["spex_sure"] = True
        if self.search_priority is not None:
            sp["custom_params"]["spex_search_priority"] = int(self.search_priority)
        if self.stop:
            sp["stop"] = list(self.stop)
        if self.seed is not None:
            sp["sampling_seed"] = int(self.seed)
        return sp


@dataclass
class GenResult:
    rid: str
    text: str
    output_ids: List[int]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: Optional[str] = None
    logprobs: List[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency: float = 0.0
    abort_message: Optional[str] = None  # SGLang's reason for aborting the request, where it gave one

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_sglang(cls, rid: str, out: Dict[str, Any], latency: float = 0.0) -> "GenResult":
        """Build from SGLang's ``/generate`` response dict (same shape in-process and over HTTP)."""
        meta = out.get("meta_info", {})
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type", "length") if isinstance(fr, dict) else str(fr)
        matched = fr.get("matched") if isinstance(fr, dict) else None
        lps = [x[0] for x in meta.get("output_token_logprobs") or [] if x and x[0] is not None]
        return cls(
            rid=rid,
            text=out.get("text", ""),
            output_ids=list(out.get("output_ids") or []),
            finish_reason="abort" if kind == "abort" else kind,
            matched_stop=matched if isinstance(matched, str) else None,
            logprobs=lps,
            prompt_tokens=meta.get("prompt_tokens", 0),
            completion_tokens=meta.get("completion_tokens", 0),
            cached_tokens=meta.get("cached_tokens", 0) or 0,
            latency=latency,
            abort_message=_abort_reason(fr) if kind == "abort" else None,
        )


def _abort_reason(finish_reason: Any) -> Optional[str]:
    """SGLang's reason for an abort; None where it gave none beyond "Aborted"."""
    said = str(finish_reason.get("message") or "").strip() if isinstance(finish_reason, dict) else ""
    return said if said.lower() not in ("", "aborted") else None


class EngineLost(RuntimeError):
    """The engine holding a search's requests is gone: the search fails (its other requests cannot go on there)."""


class EnginePort(abc.ABC):
    """What a search needs from an engine."""

    @abc.abstractmethod
    async def generate(self, req: GenRequest) -> GenResult:
        """Run one request to completion (or abort); an aborted request returns ``finish_reason="abort"``."""

    @abc.abstractmethod
    async def abort(self, rid_or_prefix: str) -> None:
        """Abort a request, or every request whose rid starts with the prefix."""

    async def release(self, search_id: str) -> None:
        """The search ended: drop the engine-side protection of its cached prefixes; no-op where unsupported."""

    async def promote(self, rid: str) -> None:
        """Raise a speculative request to primary rank (the search now waits on it); no-op where unsupported."""

    async def stats(self) -> Dict[str, Any]:
        """Engine-side load figures where available (batch size, KV use)."""
        return {}

    def stopping(self) -> bool:
        """The engine is shutting down (long-running work of ours should stop submitting); False where unknown."""
        return False

    async def close(self) -> None:
        pass

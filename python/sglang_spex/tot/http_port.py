"""The client-side engine port: any SGLang HTTP endpoint (``/generate``, ``/abort_request``).

``api_key`` is sent as ``Authorization: Bearer`` on every request (a server started with ``--api-key``). The SPEX
control calls (``/spex/promote``, ``/spex/release``) are admin-scoped: against a server with ``--admin-api-key``
they need that key, and without it they are refused and ignored (the search still runs, unprotected).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Set

import httpx

from sglang_spex.tot.engine import EnginePort, GenRequest, GenResult


class HttpPort(EnginePort):
    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        client: Optional[httpx.AsyncClient] = None,
        api_key: Optional[str] = None,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = client or httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=256), headers=headers
        )
        self.inflight: Set[str] = set()

    async def generate(self, req: GenRequest) -> GenResult:
        body: Dict[str, Any] = {"text": req.prompt, "sampling_params": req.sampling_params(), "rid": req.rid}
        if req.return_logprob:
            body["return_logprob"] = True
        if req.priority is not None:
            body["priority"] = req.priority
        if req.dp_rank is not None:
            body["routed_dp_rank"] = req.dp_rank
        t0 = time.monotonic()
        self.inflight.add(req.rid)
        try:
            r = await self.client.post(self.base_url + "/generate", json=body)
        finally:
            self.inflight.discard(req.rid)
        if r.status_code >= 400 and "abort" in r.text.lower():
            return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")
        r.raise_for_status()
        return GenResult.from_sglang(req.rid, r.json(), time.monotonic() - t0)

    async def abort(self, rid_or_prefix: str) -> None:
        # SGLang's HTTP abort only reaches rids it knows by name: expand a prefix to our in-flight rids.
        for rid in [r for r in list(self.inflight) if r.startswith(rid_or_prefix)]:
            await self.client.post(self.base_url + "/abort_request", json={"rid": rid})

    async def _spex_control(self, route: str, body: Dict[str, Any]) -> None:
        try:  # a sglang-spex server acts on it; any other server answers 404 (or 409 without SPEX): ignore
            await self.client.post(self.base_url + route, json=body)
        except httpx.HTTPError:
            pass

    async def promote(self, rid: str) -> None:
        await self._spex_control("/spex/promote", {"rid": rid})

    async def release(self, search_id: str) -> None:
        await self._spex_control("/spex/release", {"search_id": search_id})

    async def close(self) -> None:
        await self.client.aclose()

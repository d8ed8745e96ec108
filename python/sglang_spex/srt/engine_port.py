"""The in-process engine port: server-side searches submit through SGLang's TokenizerManager.

Requests take SGLang's normal path (tokenize → scheduler → detokenize), exactly like ``/generate`` but
without an HTTP round trip back to ourselves.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Optional

from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_spex.srt import control
from sglang_spex.tot.engine import EngineLost, EnginePort, GenRequest, GenResult


class TokenizerManagerPort(EnginePort):
    """``EnginePort`` over SGLang's TokenizerManager; ``spex_control``: the scheduler knows our control message
    (``--tot-speculation``), else promote/release are no-ops."""

    def __init__(self, tokenizer_manager: Any, spex_control: bool = False):
        self.tm = tokenizer_manager
        self.spex_control = spex_control

    async def generate(self, req: GenRequest) -> GenResult:
        obj = GenerateReqInput(
            text=req.prompt,
            sampling_params=req.sampling_params(),
            rid=req.rid,
            return_logprob=req.return_logprob,
            priority=req.priority,
            routed_dp_rank=req.dp_rank,
        )
        t0 = time.monotonic()
        try:
            out = await self.tm.generate_request(obj, None).__anext__()
        except ValueError as e:  # SGLang raises on requests aborted before they produced output
            if "abort" not in str(e).lower():
                raise
            out = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": str(e)}}}
        return GenResult.from_sglang(req.rid, out, time.monotonic() - t0)

    async def capacity(self) -> Dict[str, Optional[int]]:
        """What the engine can hold: the model's context length and longest prompt, the scheduler's
        running-request slots and its KV pool in tokens (one ``get_internal_state`` round trip, W3); raises
        :class:`EngineLost` when the schedulers do not all answer within ``control.SCHEDULER_TIMEOUT_S``."""
        states = await control.ranked_states(self.tm.get_internal_state())
        if states is None:
            raise EngineLost(f"the schedulers did not all answer within {control.SCHEDULER_TIMEOUT_S:g} s")
        state = states[0] if states else {}
        return {
            "context_len": int(self.tm.context_len),
            "max_input_len": getattr(self.tm, "max_req_input_len", None),
            "max_running_requests": state.get("effective_max_running_requests_per_dp"),
            "kv_tokens": (state.get("memory_usage") or {}).get("token_capacity"),
        }

    async def count_tokens(self, text: str) -> int:
        """``text``'s length in the served model's tokens (off the event loop: a long text takes a while)."""
        tokenizer = self.tm.tokenizer
        return len(await asyncio.to_thread(tokenizer.encode, text))

    def rids(self, prefix: str) -> List[str]:
        """The rids SGLang still tracks that start with ``prefix``."""
        return [r for r in list(self.tm.rid_to_state) if r.startswith(prefix)]

    async def abort(self, rid_or_prefix: str) -> None:
        # TokenizerManager.abort_request only forwards rids it knows; expand a prefix to those rids.
        for rid in self.rids(rid_or_prefix):
            self.tm.abort_request(rid)

    async def _control(self, **fields: Any) -> None:
        if self.spex_control:
            await control.send(self.tm, control.SpexControlReq(**fields))

    async def promote(self, rid: str) -> None:
        """Queued to the scheduler in order with this process's requests; not waited for (a round trip per
        adopted node would cost the scheduler a full state report each)."""
        if self.spex_control:
            control.post(self.tm, control.SpexControlReq(op="promote", prefix=rid))

    async def release(self, search_id: str) -> None:
        await self._control(op="release", search_id=search_id)

    async def stats(self) -> Dict[str, Any]:
        return {"inflight": len(self.tm.rid_to_state)}

    def stopping(self) -> bool:
        """SIGTERM reached SGLang: it drains its requests (``sigterm_watchdog``) and exits once none is left."""
        return bool(getattr(self.tm, "gracefully_exit", False))

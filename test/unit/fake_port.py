"""A deterministic in-memory EnginePort for policy tests without a server."""

from __future__ import annotations

import asyncio
import random
from typing import List

from sglang_spex.tot.engine import EnginePort, GenRequest, GenResult


class FakePort(EnginePort):
    """Text is a pure function of (prompt depth, seed): an arithmetic step, sometimes wrong, sometimes final."""

    def __init__(self, answer_from_depth: int = 2, delay: float = 0.0):
        self.answer_from_depth = answer_from_depth
        self.delay = delay
        self.requests: List[GenRequest] = []
        self.aborted: List[str] = []

    async def generate(self, req: GenRequest) -> GenResult:
        self.requests.append(req)
        if self.delay:
            await asyncio.sleep(self.delay)
        if any(req.rid.startswith(p) for p in self.aborted):
            return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")
        rng = random.Random(req.seed)
        depth = req.prompt.count("\n\n") + 1
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = a + b if rng.random() < 0.7 else a + b + 1
        text = f"{a} + {b} = {c}."
        if depth >= self.answer_from_depth and rng.random() < 0.5:
            text += f" The answer is {c}."
        lps = [-rng.random() for _ in range(5)]
        return GenResult(
            rid=req.rid,
            text=text,
            output_ids=list(range(5)),
            finish_reason="stop",
            matched_stop="\n\n",
            logprobs=lps,
            completion_tokens=5,
        )

    async def abort(self, rid_or_prefix: str) -> None:
        self.aborted.append(rid_or_prefix)

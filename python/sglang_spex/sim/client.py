"""What a request costs outside the engine's forward passes: the client and the serving pipeline around it.

A real search talks to SGLang over HTTP. Between the moment the engine finishes a node and the moment the next
node reaches the engine there is work no decode step accounts for:

- ``request_s``: the search issued a request; it can be scheduled ``request_s`` later (client JSON + HTTP,
  SGLang's tokenizer, the hop to the scheduler). That path (SGLang's HTTP server and tokenizer are one event
  loop) takes one request at a time: a wave of N requests reaches the scheduler spread over ``N · request_s``,
  so the first one is often prefilled alone and the rest find its prompt in the radix cache;
- ``response_s``: the engine finished a request; the search sees the result ``response_s`` later (detokenizer,
  HTTP response);
- ``cpu_s``: client-process CPU per request (the search policy, SPEX's planning and bookkeeping, the reward,
  answer extraction, parsing). The client is one Python thread, so this work queues: N results that arrive
  together take ``N · cpu_s`` to digest, in arrival order.

The response path is a latency (requests overlap in it); the request path and the client thread are serial.
:class:`~sglang_spex.sim.engine.SimPort` charges all three in virtual time around every ``generate``; the
search, SPEX and budget code run unchanged. GPU device models default to zero (no overhead); the
``cpu-measured`` calibration measures them on the real server (``benchmark/calib_real.py``).
"""

from __future__ import annotations

import asyncio
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Dict


@dataclass(frozen=True)
class ClientOverhead:
    """Per-request costs outside the engine (seconds; see the module docstring)."""

    request_s: float = 0.0
    response_s: float = 0.0
    cpu_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value >= 0):
                raise ValueError(f"ClientOverhead.{name} must be a finite number >= 0 (seconds), got {value!r}")

    @property
    def is_zero(self) -> bool:
        return self.request_s == 0 and self.response_s == 0 and self.cpu_s == 0

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)


NO_OVERHEAD = ClientOverhead()


class SerialResource:
    """One worker in virtual time (the client's Python thread, the request path): jobs run first come, first
    served."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0
        self.jobs = 0

    async def run(self, seconds: float) -> None:
        """Occupy the thread for ``seconds`` once it is free; return when that work is done."""
        if seconds <= 0:
            return
        now = asyncio.get_running_loop().time()
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        self.jobs += 1
        await asyncio.sleep(self.free_at - now)

"""Real ReSpec test servers in a given scheduler mode (``overlap`` / ``no-overlap``, see ``test/server_modes.py``).

With speculative decoding on CPU, SGLang 0.5.23 itself turns the overlap scheduler off; the launcher's
``--enable-overlap-schedule`` keeps it for NGRAM (touch point L1). SGLang's EAGLE overlap path does not run on
CPU at all (``FutureMap`` gathers the draft state with a Triton kernel, and there is no Triton driver here), so
EAGLE3 servers run both modes only where a GPU is present.
"""

from __future__ import annotations

from typing import Sequence

import requests
from server_modes import MODES, mode_args

from sglang_spex.launch_server import has_gpu
from sglang_spex.serve import ServerProcess

NGRAM_MODES = MODES
EAGLE_MODES = MODES if has_gpu() else ("no-overlap",)


class RespecServer(ServerProcess):
    """A test server running SGLang's scheduler loop ``mode``, checked on ``/get_server_info`` once started."""

    def __init__(self, args: Sequence[str], mode: str):
        super().__init__([*args, *mode_args(mode)])
        self.mode = mode

    def start(self) -> "RespecServer":
        super().start()
        try:
            info = requests.get(self.url + "/get_server_info", timeout=60).json()
            if bool(info["disable_overlap_schedule"]) != (self.mode == "no-overlap"):
                raise RuntimeError(f"asked for {self.mode}, SGLang runs {info['disable_overlap_schedule']=}")
        except Exception:
            self.stop()
            raise
        return self

"""Real ReSpec test servers in a given scheduler mode (``overlap`` / ``no-overlap``, see ``test/server_modes.py``).

With speculative decoding on CPU, SGLang 0.5.23 itself turns the overlap scheduler off; the launcher keeps it
unless ``--disable-overlap-schedule`` is given (touch point L1), and hook V2 lets the EAGLE family's overlap relay
(``FutureMap``, a Triton gather in SGLang) run on CPU. So NGRAM and EAGLE3 servers run in both modes everywhere.
"""

from __future__ import annotations

from typing import Sequence

import requests
from server_modes import MODES, mode_args

from sglang_spex.serve import ServerProcess

NGRAM_MODES = MODES
EAGLE_MODES = MODES


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

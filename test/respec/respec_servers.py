"""Real ReSpec test servers in a given scheduler mode (``overlap`` / ``no-overlap``, see ``test/server_modes.py``).

With speculative decoding on CPU, SGLang 0.5.23 itself turns the overlap scheduler off; an ``overlap`` server
without a GPU therefore starts through ``spec_overlap_launch.py`` (our launcher with that startup guard lifted).
SGLang's EAGLE overlap path does not run on CPU at all (``FutureMap`` gathers the draft state with a Triton kernel,
and there is no Triton driver here), so EAGLE3 servers run both modes only where a GPU is present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence
from unittest import mock

import requests
from server_modes import MODES, mode_args

from sglang_spex.launch_server import has_gpu
from sglang_spex.serve import ServerProcess

SPEC_OVERLAP_LAUNCHER = str(Path(__file__).with_name("spec_overlap_launch.py"))
NGRAM_MODES = MODES
EAGLE_MODES = MODES if has_gpu() else ("no-overlap",)
_POPEN = subprocess.Popen


def _popen_spec_overlap(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``python -m sglang_spex.launch_server ARGS`` -> ``python spec_overlap_launch.py ARGS``."""
    assert list(cmd[1:3]) == ["-m", "sglang_spex.launch_server"], cmd
    return _POPEN([sys.executable, SPEC_OVERLAP_LAUNCHER, *cmd[3:]], **kwargs)


class RespecServer(ServerProcess):
    """A test server running SGLang's scheduler loop ``mode``, checked on ``/get_server_info`` once started."""

    def __init__(self, args: Sequence[str], mode: str):
        super().__init__([*args, *mode_args(mode)])
        self.mode = mode

    def start(self) -> "RespecServer":
        if self.mode == "overlap" and not has_gpu():
            with mock.patch("subprocess.Popen", _popen_spec_overlap):
                super().start()
        else:
            super().start()
        try:
            info = requests.get(self.url + "/get_server_info", timeout=60).json()
            if bool(info["disable_overlap_schedule"]) != (self.mode == "no-overlap"):
                raise RuntimeError(f"asked for {self.mode}, SGLang runs {info['disable_overlap_schedule']=}")
        except Exception:
            self.stop()
            raise
        return self

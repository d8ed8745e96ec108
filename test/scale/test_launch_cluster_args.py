"""``scripts/launch_cluster.py`` refuses a server count below 1 with argparse's one-line error, before any start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_cluster.py"


@pytest.mark.parametrize("servers", ["0", "-1", "two"])
def test_a_server_count_below_one_exits_2_with_one_line(servers):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--servers", servers], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "argument --servers:" in last and last.endswith("expected an integer >= 1"), last

"""The prepared GPU check's wiring: the shell script parses and the python driver answers ``--help`` (fast; the
dry run itself starts servers and is run by hand: ``bash scripts/gpu_check.sh --dry-run``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shell_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_driver_help_lists_the_dry_run():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "--dry-run" in r.stdout and "--budget-s" in r.stdout

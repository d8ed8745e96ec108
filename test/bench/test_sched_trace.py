"""benchmark/sched_trace.py: CPU seconds per server process role, and bench_tot's time split reporting them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import sched_trace  # noqa: E402
import tot_report  # noqa: E402

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"


def test_cpu_seconds_by_role_of_a_process_tree():
    """A child whose command line names SGLang's scheduler is counted as the scheduler, the root as the launcher."""
    child = subprocess.Popen(["bash", "-c", f'exec -a sglang::scheduler {sys.executable} -c "{BUSY}"'])
    try:
        deadline = time.monotonic() + 20
        got = {}
        while time.monotonic() < deadline and got.get("scheduler", 0.0) < 0.25:
            got = sched_trace.cpu_seconds(os.getpid())
            time.sleep(0.1)
        assert got["scheduler"] >= 0.25 and got["tokenizer_manager"] > 0.0
    finally:
        child.kill()
        child.wait()
    assert sched_trace.cpu_seconds(None) == {}
    assert sched_trace.cpu_delta({"scheduler": 1.0}, {"scheduler": 3.5, "other": 1.0}) == {
        "scheduler": 2.5,
        "other": 1.0,
    }


def test_time_split_reports_median_cpu_per_role():
    def row(tm):
        trace = {"decode_steps": 10, "decode_s": 1.0, "prefill_s": 0.5, "mean_decode_batch": 2.0}
        return {"trace": {**trace, "cpu_s": {"tokenizer_manager": tm, "scheduler": 9.0}}}

    split = tot_report._time_split([row(1.0), row(3.0), row(2.0)], 1)
    assert split["cpu_s"] == {"scheduler": 9.0, "tokenizer_manager": 2.0}
    assert tot_report._cpu(split, {"cpu_s": {"scheduler": 12.5}}, "scheduler") == "9 -> 12.5"
    assert tot_report._cpu(split, {}, "scheduler") == "-"

"""launch_cluster / Cluster refusals (review 39, findings 6-8), no server started: ``--host`` / ``--port`` after
``--`` are refused instead of being overridden; each refusal names the flag at fault; the too-few-GPUs refusal
names ``--base-gpu-id`` / ``--gpu-id-step``, which enlarge each server's slice."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from types import ModuleType
from typing import Iterator, List

import pytest

from sglang_spex.config import ConfigError
from sglang_spex.scale import router as router_mod
from sglang_spex.scale.cluster import Cluster, ranks_per_server
from sglang_spex.serve import STOP_SIGNALS, free_port

STARTS_NO_SERVER = True  # Cluster is planned, its start faked, or its servers are shell children (conftest)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_cluster.py"
NOT_INSTALLED = "sglang-router is not installed"


class Started(Exception):
    """Raised instead of starting servers: a refusal that did not happen."""


@pytest.fixture
def launch_cluster(monkeypatch) -> Iterator[ModuleType]:
    """The script as a module, its ``Cluster.start`` replaced by a :class:`Started` raise; the signal handlers
    ``main`` sets once its checks pass are put back afterwards."""
    spec = importlib.util.spec_from_file_location("launch_cluster_review39", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def start(self):
        raise Started

    monkeypatch.setattr(module.Cluster, "start", start)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield module
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _refusal(module: ModuleType, capsys, argv: List[str]) -> str:
    """The one stderr line of ``main(argv)``, which must exit 2 before any server starts."""
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "server_args, named",
    [
        (["--host", "0.0.0.0"], "--host '0.0.0.0'"),
        (["--port", "31000"], "--port '31000'"),
        (["--tp-size", "1", "--port=31000"], "--port '31000'"),
    ],
    ids=["host", "port", "port="],
)
def test_host_or_port_after_dashdash_is_refused_naming_it(launch_cluster, capsys, server_args, named):
    """ServerProcess appends its own ``--host 127.0.0.1 --port <free>``, which SGLang's argparse keeps: a user's
    would be overridden without a word."""
    argv = ["--port", str(free_port()), "--", "--model-path", "m", *server_args]
    line = _refusal(launch_cluster, capsys, argv)
    assert line.startswith(f"launch_cluster.py: error: after --: {named}: set by the cluster"), line
    assert "127.0.0.1" in line


def test_a_missing_router_package_is_not_blamed_on_port(launch_cluster, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        router_mod.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "sglang_router" else real(name, *a, **k),
    )
    line = _refusal(launch_cluster, capsys, ["--port", str(free_port())])
    assert line.startswith(f"launch_cluster.py: error: {NOT_INSTALLED}"), line
    assert "--port" not in line


@pytest.mark.parametrize(
    "server_args, message",
    [
        (["--tp-size", "two"], "--tp-size 'two': expected an integer >= 1"),
        (["--base-gpu-id", "x"], "--base-gpu-id 'x': expected an integer >= 0"),
    ],
    ids=["tp-size", "base-gpu-id"],
)
def test_a_bad_server_arg_is_named_as_that_flag_not_servers(launch_cluster, capsys, server_args, message):
    argv = ["--servers", "2", "--port", str(free_port()), "--", "--model-path", "m", *server_args]
    line = _refusal(launch_cluster, capsys, argv)
    assert line == f"launch_cluster.py: error: after --: {message}", line


@pytest.mark.parametrize("flag", ["--host", "--port"])
def test_cluster_plan_refuses_host_and_port_in_server_args(flag):
    c = Cluster(["--model-path", "m", flag, "x"], n=2, bind=False, gpus=[])
    with pytest.raises(ConfigError, match=f"^{flag} 'x': set by the cluster"):
        c.plan()
    assert c.envs is None and c.servers == []


def test_the_too_few_gpus_refusal_names_base_gpu_id_and_gpu_id_step():
    """docs/scale.md's rule: a slice holds the largest GPU id the args index + 1 (SGLang indexes the visible GPUs
    by those ids), so --base-gpu-id 1 or --gpu-id-step 2 with --tp-size 2 reserve 3 GPUs; refused on 4 GPUs for 2
    servers, and the refusal names the flags that can be lowered."""
    assert ranks_per_server(["--tp-size", "2"]) == 2
    assert ranks_per_server(["--base-gpu-id", "1", "--tp-size", "2"]) == 3
    assert ranks_per_server(["--tp-size", "2", "--gpu-id-step", "2"]) == 3
    assert ranks_per_server(["--tp-size", "2", "--dp-size", "2", "--gpu-id-step", "2"]) == 7  # ids 0, 2, 4, 6
    c = Cluster(["--model-path", "m", "--base-gpu-id", "1", "--tp-size", "2"], n=2, gpus=["0", "1", "2", "3"])
    with pytest.raises(ConfigError, match="2 servers x 3 GPU") as refused:
        c.plan()
    assert "--base-gpu-id" in str(refused.value) and "--gpu-id-step" in str(refused.value)
    assert c.servers == []

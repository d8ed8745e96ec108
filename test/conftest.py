"""Session-scoped real SGLang servers shared by the suite (each start costs ~20 s on CPU)."""

from __future__ import annotations

import os

import pytest

from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
from sglang_spex.serve import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# float32: the identity tests compare trees generated in different batch compositions; bf16 logits of one
# request shift with its batch neighbours (see docs/architecture.md), float32 keeps those shifts negligible.
TINY = ["--dtype", "float32", "--model-path"]


def _server(args):
    srv = ServerProcess(args)
    srv.start()
    return srv


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(prepare_tiny_llama())


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def spex_server(tiny_model):
    """Tiny Llama served with --tot-speculation (the plugin's hooks active)."""
    srv = _server([*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "8", "--enable-metrics"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def plain_server(tiny_model):
    """The same launcher without --tot-speculation: plain SGLang, plugin inert."""
    srv = _server([*TINY, tiny_model])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_model):
    srv = _server(["--model-path", smollm2_model, "--tot-speculation"])
    yield srv
    srv.stop()

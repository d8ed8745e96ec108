"""Two tiny sglang-spex servers behind sglang-router (manual policy), shared by a module's tests.

Every worker logs each request it receives and finishes (SGLang's ``--log-requests``, JSON; read by
``helpers.py``), so the tests see *from the workers* which of them served a search's requests and how each ended.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from server_modes import spex_args

from sglang_spex.scale.cluster import Cluster

REQUEST_LOG = ["--log-requests", "--log-requests-level", "0", "--log-requests-format", "json"]


@pytest.fixture(scope="module")
def cluster(tiny_model) -> Iterator[Cluster]:
    c = Cluster([*spex_args(tiny_model), *REQUEST_LOG], n=2, policy="manual").start()
    yield c
    c.stop()

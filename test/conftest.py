"""Session-scoped real SGLang servers shared by the suite (each start costs ~20 s on CPU).

Scheduler modes (``server_modes.py``): ``overlap`` is SGLang's ``event_loop_overlap`` (its GPU default),
``no-overlap`` its ``event_loop_normal`` (``--disable-overlap-schedule``). The launcher keeps SGLang's default,
overlap, on CPU too. ``spex_server`` runs in the default mode;
``spex_server_in_mode`` runs a test once per mode (its default-mode instance is the same server).

Every test whose fixtures (directly or through other fixtures) start a server is marked ``server``
automatically, so ``pytest -m "not server"`` starts none. A module that names a server starter without starting one
(``Cluster`` planned, or its ``start`` faked) says so with ``STARTS_NO_SERVER = True``; its tests then count only the
shared server fixtures.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pkgutil
import socket
import tempfile
import types
from typing import Iterator, List, Set

import pytest
import warm_launchers
from server_modes import DEFAULT_MODE, MODES, TINY, spex_args, start_server

from sglang_spex import serve
from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
from sglang_spex.serve import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite serves only Llama-family models (the tiny Llama, SmolLM2, their EAGLE3 drafters). SGLang's model registry
# imports every model module of sglang.srt.models at startup; skipping the others saves about 2 s per server start.
SERVED_MODEL_MODULES = {"llama", "llama_eagle", "llama_eagle3"}


def _other_model_modules() -> str:
    spec = importlib.util.find_spec("sglang.srt.models")  # its modules are listed, not imported
    names = {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations) if not m.ispkg}
    return ",".join(sorted(names - SERVED_MODEL_MODULES))


os.environ.setdefault("SGLANG_DISABLED_MODEL_ARCHS", _other_model_modules())  # SGLang's own switch

SERVER_FIXTURES = {
    "spex_server",
    "spex_server_in_mode",
    "plain_server",
    "smollm2_server",
    "small_pool_server",
}


def _code_names(code: types.CodeType) -> Set[str]:
    names = set(code.co_names)
    for const in code.co_consts:  # comprehensions, lambdas, nested functions
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _starts_server(fn: object, depth: int = 3) -> bool:
    """``fn`` constructs a ``ServerProcess``, itself or through functions of its own module or of the package
    (``depth`` calls)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    names = _code_names(code)
    if names & {"ServerProcess", "start_server", "Cluster"}:  # start_server (server_modes.py), Cluster (scale/)
        return True
    module_globals = getattr(fn, "__globals__", {})
    return depth > 0 and any(
        _starts_server(module_globals[n], depth - 1)
        for n in names
        if inspect.isfunction(module_globals.get(n)) and _followed(module_globals[n].__module__, fn.__module__)
    )


def _followed(module: str, caller: str) -> bool:
    """Calls followed by :func:`_starts_server`: into the caller's own module, and into the package (``run_rl``
    starts its server inside ``sglang_spex.respec.rl_loop``)."""
    return module == caller or module.split(".")[0] == "sglang_spex"


def _uses_server(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))  # the whole fixture closure, not only direct arguments
    if names & SERVER_FIXTURES:
        return True
    if getattr(getattr(item, "module", None), "STARTS_NO_SERVER", False):  # its Cluster is planned or faked only
        return False
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    funcs = [getattr(item, "function", None)] + [d.func for ds in defs.values() for d in ds]
    return any(_starts_server(f) for f in funcs if f is not None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-spec-algorithms",
        action="store_true",
        help="test_spec_distribution: also EAGLE3 chain and STANDALONE tree (the suite runs NGRAM and EAGLE3 tree)",
    )
    parser.addoption(
        "--cold-launchers",
        action="store_true",
        help="start every test server with a fresh launcher process (default: a spare that imported SGLang already)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Mark every test that starts or uses a real server ``server``."""
    for item in items:
        if _uses_server(item):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session", autouse=True)
def _temp_files_in_pytest_basetemp(tmp_path_factory) -> Iterator[None]:
    """Server logs (``ServerProcess``) and other temp files go under pytest's base temp, which keeps the last
    three runs, instead of piling up in the system temp dir (a run starts ~40 servers)."""
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = before


@pytest.fixture(autouse=True)
def _environ_kept() -> Iterator[None]:
    """What a test sets in ``os.environ`` (e.g. ``launch_server.prepare`` exports the config and the CPU
    environment) is undone after it, so later tests and the servers they start see the run's own environment."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


WARM_LAUNCHERS = pytest.StashKey[warm_launchers.WarmLaunchers]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    pool = config.stash.get(WARM_LAUNCHERS, None)
    if pool is not None:
        terminalreporter.write_line(f"test servers: {pool.taken} started by a spare launcher, {pool.cold} cold")


@pytest.fixture(scope="session", autouse=True)
def _warm_launchers(request) -> Iterator[None]:
    """Server starts take a spare launcher that imported SGLang in the background (``warm_launchers.py``), when
    the run has server tests and ``--cold-launchers`` is not given."""
    session = request.session
    wanted = any(item.get_closest_marker("server") for item in session.items)
    if not wanted or request.config.getoption("--cold-launchers") or not warm_launchers.usable():
        yield
        return
    pool = warm_launchers.WarmLaunchers()
    request.config.stash[WARM_LAUNCHERS] = pool
    with pytest.MonkeyPatch.context() as mp:
        pool.install(mp)
        pool.refill()
        try:
            yield
        finally:
            pool.close()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(prepare_tiny_llama())


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    return str(prepare_smollm2())


@pytest.fixture(scope="session")
def _default_spex_server(tiny_model) -> Iterator[ServerProcess]:
    srv = start_server(spex_args(tiny_model), DEFAULT_MODE)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def spex_server(_default_spex_server) -> ServerProcess:
    """Tiny Llama served with --tot-speculation (the plugin's hooks active), default scheduler mode."""
    return _default_spex_server


@pytest.fixture(scope="session", params=MODES)
def spex_server_in_mode(request, tiny_model) -> Iterator[ServerProcess]:
    """The --tot-speculation tiny server in each scheduler mode (the default-mode one is ``spex_server``)."""
    if request.param == DEFAULT_MODE:
        yield request.getfixturevalue("_default_spex_server")
        return
    srv = start_server(spex_args(tiny_model), request.param)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def plain_server(tiny_model) -> Iterator[ServerProcess]:
    """The same launcher without --tot-speculation: plain SGLang, plugin inert. The port it picks first is held by
    another socket (``taken_port``), so ``ServerProcess`` must notice and start it on a free one
    (``test_server_port_retry.py``); the launcher refuses a taken port before SGLang loads, so this costs ~2 s."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(serve, "free_port", lambda: taken.getsockname()[1])  # the port ServerProcess picks first
            srv = ServerProcess([*TINY, tiny_model])
        srv.taken_port = taken.getsockname()[1]
        srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_model) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--model-path", smollm2_model, "--tot-speculation"]).start()
    yield srv
    srv.stop()


@pytest.fixture
def hung_worker() -> Iterator[str]:
    """The URL of a worker that accepts connections and never answers (its backlog; nothing reads)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()

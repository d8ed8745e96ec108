"""Hook contracts: every SGLang touch point in ``srt/hooks.py`` resolves in the installed SGLang with the signature
recorded for 0.5.23, ``docs/upstream.md`` lists the same ids, and a renamed SGLang method fails the contract and
turns its feature off loudly at registration (no server, except the last test)."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import re
import sys
from pathlib import Path

import httpx
import pytest
import sglang
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_spex import config
from sglang_spex.config import SpexConfig
from sglang_spex.srt import hooks, lossless_verify

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_DOC = ROOT / "docs" / "upstream.md"
DOC_HEADER = "| id | target | type | condition | why |"
RENAMED = "abort_request"  # H9's method; the scheduler feature must go whole when it disappears


@pytest.fixture
def clean_registry(monkeypatch):
    """An empty HookRegistry for one test (the process's own entries are put back afterwards), in a process that
    is not SGLang's HTTP server (resolving W1 imported ``http_server``; its app must not get our routes here)."""
    monkeypatch.delitem(sys.modules, hooks.HTTP_SERVER_MODULE, raising=False)
    monkeypatch.setenv(config.ENV_VAR, "")  # the defaults, whatever an earlier test left in the environment
    config.reset()
    saved = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)
    HookRegistry.reset()
    yield
    config.reset()
    HookRegistry.reset()
    HookRegistry._hooks.update(saved)
    HookRegistry._patched.update(patched)


def _rename_scheduler_method(monkeypatch, name: str) -> None:
    """Rename ``Scheduler.<name>`` to ``<name>_renamed`` on the class that defines it (as a version bump would)."""
    owner = next(c for c in Scheduler.__mro__ if name in c.__dict__)
    method = owner.__dict__[name]
    monkeypatch.delattr(owner, name)
    monkeypatch.setattr(owner, f"{name}_renamed", method, raising=False)
    assert not hasattr(Scheduler, name)


def _doc_rows() -> list:
    lines = UPSTREAM_DOC.read_text().splitlines()
    start = lines.index(DOC_HEADER)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def test_every_target_resolves_with_the_recorded_signature():
    recorded = hooks.recorded_signatures()
    assert recorded["sglang_version"] == sglang.__version__ == "0.5.23"
    assert hooks.check_contracts(recorded=recorded) == []
    assert set(recorded["targets"]) == {tp.target for tp in hooks.TOUCH_POINTS}  # nothing stale, nothing missing


def test_table_is_well_formed_and_names_existing_code():
    ids = [tp.id for tp in hooks.TOUCH_POINTS]
    assert len(ids) == len(set(ids))
    features = {f.name: f for f in hooks.FEATURES}
    assert len(features) == len(hooks.FEATURES)
    for f in hooks.FEATURES:
        assert f.condition in hooks.CONDITIONS, f
        assert hooks.points_of(f.name), f"feature {f.name} has no touch point"
        if f.setup:
            assert callable(hooks.load_ref(f.setup)), f.setup
    for tp in hooks.TOUCH_POINTS:
        assert tp.feature in features, tp
        assert tp.kind in hooks.HOOK_KINDS + hooks.OTHER_KINDS, tp
        assert tp.target.startswith("sglang."), tp
        assert tp.why, tp
        if tp.is_hook:  # our hook body exists under the name the table gives (catches renames on our side)
            assert callable(hooks.load_ref(tp.fn)), tp
        elif tp.fn:
            hooks.load_ref(tp.fn)
        if ":" in tp.by:
            assert callable(hooks.load_ref(tp.by)), tp
        if tp.by:  # the module said to make or call it does name the target
            module = importlib.import_module(tp.by.partition(":")[0])
            assert tp.target.rsplit(".", 1)[1] in inspect.getsource(module), (tp.id, tp.by)


def test_module_hook_lists_match_the_table():
    """A hook module that lists its own hooks (``HOOKS``) lists exactly the table's records of its feature."""
    table = {(tp.id, tp.target, hooks.load_ref(tp.fn), tp.kind) for tp in hooks.points_of("lossless_verify")}
    assert table == {(i, target, fn, kind.name) for i, target, fn, kind in lossless_verify.HOOKS}


def test_upstream_doc_lists_the_same_touch_points():
    rows = _doc_rows()
    assert rows and all(len(r) == 5 for r in rows), [r for r in rows if len(r) != 5]
    by_id = {tp.id: tp for tp in hooks.TOUCH_POINTS}
    doc_ids = [r[0] for r in rows]
    assert len(doc_ids) == len(set(doc_ids))
    assert set(doc_ids) == set(by_id), set(doc_ids) ^ set(by_id)
    for hook_id, target, kind, condition, why in rows:
        tp = by_id[hook_id]
        assert ".".join(tp.target.split(".")[-2:]) in target, (hook_id, target, tp.target)
        assert kind.upper() == tp.kind.upper(), (hook_id, kind, tp.kind)
        assert condition and why, hook_id


def test_renamed_sglang_method_fails_the_contract(monkeypatch):
    assert hooks.check_contracts() == []
    _rename_scheduler_method(monkeypatch, RENAMED)
    problems = hooks.check_contracts()
    assert len(problems) == 1 and problems[0].startswith("H9 sglang.srt.managers.scheduler.Scheduler.abort_request")
    assert "does not resolve" in problems[0]


def test_changed_signature_fails_the_contract(monkeypatch):
    monkeypatch.setattr(Scheduler, RENAMED, lambda self, recv_req, force=False: None)
    problems = hooks.check_contracts()
    assert len(problems) == 1 and "signature (self, recv_req, force=False) != recorded" in problems[0], problems


def test_renamed_sglang_method_disables_its_feature_loudly(monkeypatch, caplog, clean_registry):
    _rename_scheduler_method(monkeypatch, RENAMED)
    with caplog.at_level(logging.ERROR, logger=hooks.__name__):
        plan = hooks.register_all(SpexConfig(enabled=True))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("'scheduler' DISABLED" in m and "Scheduler.abort_request" in m for m in errors), errors
    assert "scheduler" not in plan.enabled and "Scheduler.abort_request" in plan.disabled["scheduler"]
    for tp in hooks.points_of("scheduler"):  # none of the feature's hooks reached HookRegistry
        if tp.is_hook:
            assert not HookRegistry._hooks.get(tp.target), tp
    # the other features are registered as usual
    assert "seeded_sampling" in plan.enabled and "report" in plan.enabled
    for tp in [t for t in hooks.points_of("seeded_sampling") + hooks.points_of("report") if t.is_hook]:
        assert any(h == plan.fns[tp.id] for _, h, _ in HookRegistry._hooks[tp.target]), tp
    report = hooks.scheduler_report()["hooks"]
    assert [d["feature"] for d in report["disabled"]] == ["scheduler"]
    listed = {row["id"] for row in report["applied"] + report["not_applied"]}
    assert not listed & {tp.id for tp in hooks.points_of("scheduler")}
    assert {"H1", "H2", "H2b", "H2c"} <= listed


def test_without_speculation_only_the_report_and_backend_features_register(clean_registry):
    plan = hooks.register_all(SpexConfig(enabled=False))
    assert plan.disabled == {}
    assert {"seeded_sampling", "scheduler", "respec_ngram", "respec_eagle", "routes"} <= set(plan.off)
    ours = {tp.target for f in plan.enabled for tp in hooks.points_of(f) if tp.registered_here}
    assert ours == {
        f"{hooks.SCHEDULER}.get_internal_state",
        "sglang.srt.speculative.eagle_utils.eagle_sample",
        "sglang.srt.speculative.eagle_utils._verify_uses_greedy",
        "sglang.srt.managers.overlap_utils.gather_spec_extras",
        "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor",
        f"{hooks.TOKENIZER_MANAGER}._validate_one_request",
        f"{hooks.TOKENIZER_MANAGER}._tokenize_texts",
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request",
    }
    assert hooks.register_all(SpexConfig(enabled=False)) is plan  # idempotent per process
    assert len(HookRegistry._hooks[f"{hooks.SCHEDULER}.get_internal_state"]) == 1


@pytest.mark.server
def test_spex_info_lists_the_hooks_applied_in_the_scheduler(spex_server):
    info = httpx.get(spex_server.url + "/spex/info", timeout=60).json()
    report = info["scheduler"]["hooks"]
    assert report["disabled"] == [] and report["not_applied"] == [], json.dumps(report)
    applied = {row["id"] for row in report["applied"]}
    expected = {tp.id for f in ("report", "seeded_sampling", "scheduler") for tp in hooks.points_of(f)}
    assert expected <= applied, expected - applied
    assert "routes" in report["off"]  # the scheduler process serves no HTTP


def test_respec_features_register_under_respec_adaptive(monkeypatch, clean_registry):
    cfg = config.PluginConfig(respec=config.RespecConfig(enabled=True, algorithm="NGRAM"))
    monkeypatch.setenv(config.ENV_VAR, cfg.to_json())
    config.reset()
    try:
        plan = hooks.register_all(cfg.spex)
    finally:
        monkeypatch.delenv(config.ENV_VAR)
        config.reset()
    assert {"respec_ngram", "respec_report", "respec_eagle"} <= set(plan.enabled) and plan.disabled == {}
    for tp in hooks.points_of("respec_ngram") + hooks.points_of("respec_report") + hooks.points_of("respec_eagle"):
        if tp.is_hook:
            assert any(h == plan.fns[tp.id] for _, h, _ in HookRegistry._hooks[tp.target]), tp

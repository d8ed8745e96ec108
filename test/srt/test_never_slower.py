"""Never slower: the scheduler's speculative gate on a real SGLang server (tiny Llama, ``--tot-k-total 8``).

Every scheduling step is read back from the batch-stats ring (hook H13) and checked:

- a step that prefills speculative work leaves no primary waiting (primaries are admitted first);
- a step that prefills only speculative work runs while no primary is decoding (it would replace their
  decode step), unless SGLang mixes it into their decode step (``--enable-mixed-chunk``, the launcher's default
  under ``--tot-mixed-prefill``): then it is a mixed step with the decoding primaries in it;
- a decode step never leaves a primary waiting (nothing speculative delays a primary's admission);
- the speculative requests in the running batch never exceed the step's room (budget, and the knee minus
  the primary work);
- once the primary work alone reaches the knee speculation is off (running speculative requests retracted),
  and it comes back once the primaries are done: every request still finishes;
- speculative prefill beside live primary work never costs more than the step's prefill allowance
  (``--tot-spec-prefill-share`` of the primaries' step time, at the measured price of a prefill step and its prompt
  tokens), and at share 0 nothing speculative is prefilled while a primary is live.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Dict, List

import pytest
import requests
from server_modes import DEFAULT_MODE, spex_args, start_server
from srt_hook_util import body, post, sched, step_rows, step_seq, wait_idle, wait_running, wait_spec_step, words

from sglang_spex.config import SpexConfig

pytestmark = pytest.mark.server

KNEE = 8  # spex_args: --tot-k-total 8 (the scheduler's knee and initial budget)
DEFAULT_SHARE = SpexConfig().spec_prefill_share
PREFILL_MODES = (1, 3)
MIXED = 3  # the "mode" of a mixed prefill + decode step


@pytest.fixture(scope="module")
def unmixed_server(tiny_model):
    """The --tot-speculation tiny server with SGLang's prefill replacing decode steps (no mixed chunk)."""
    srv = start_server([*spex_args(tiny_model), "--tot-mixed-prefill", "off"], DEFAULT_MODE)
    yield srv
    srv.stop()


def _submit(ex: cf.Executor, url: str, reqs: List[dict]) -> List[cf.Future]:
    return [ex.submit(requests.post, url + "/generate", json=b, timeout=600) for b in reqs]


def _spec(tag: str, n: int, tokens: int) -> List[dict]:
    return [body(words(8, 100 + i), tokens, f"spex:{tag}{i}:r.{i % 3}:", "spec") for i in range(n)]


def _primary(tag: str, n: int, tokens: int) -> List[dict]:
    return [body(words(8, 200 + i), tokens, f"spex:{tag}p{i}:r:", "primary") for i in range(n)]


def _batched(reqs: List[dict]) -> dict:
    """One ``/generate`` body for several requests (SGLang's batch form: lists of texts, sampling params and rids)."""
    return {k: [b[k] for b in reqs] for k in ("text", "sampling_params", "rid")}


def _outputs(out: Any) -> List[dict]:
    return out if isinstance(out, list) else [out]


def _together(ex: cf.Executor, url: str, reqs: List[dict]) -> List[cf.Future]:
    """Submit ``reqs`` in one batched ``/generate``, so they reach the scheduler together: sent one HTTP request at a
    time, their arrivals can spread past a short request's whole run on a loaded host (CI)."""
    return _submit(ex, url, [_batched(reqs)])


def _results(futs: List[cf.Future]) -> List[dict]:
    return [o for f in futs for o in _outputs(f.result().json())]


def _waiting_primary(r: Dict[str, float]) -> float:
    return r["waiting"] - r["waiting_spec"]


def test_speculation_never_delays_a_primary(spex_server_in_mode):
    """Both scheduler loops, with the launcher's default mixed prefill: speculation rides the primaries' steps."""
    _check_gate(spex_server_in_mode.url)


def test_speculation_never_replaces_a_primary_decode_step(unmixed_server):
    """Without mixed prefill, speculative-only prefill waits for a step that does not decode primaries."""
    _check_gate(unmixed_server.url)


def _check_gate(url: str) -> None:
    post(url, "/spex/knobs", {"spec_prefill_share": 1.0})  # a whole primary step: phase 2 rides it (bounded)
    try:
        _check_gate_at_share(url)
    finally:
        post(url, "/spex/knobs", {"spec_prefill_share": DEFAULT_SHARE})


def _check_gate_at_share(url: str) -> None:
    mixed = bool(requests.get(url + "/get_server_info", timeout=60).json()["enable_mixed_chunk"])
    post(url, "/spex/release", {})
    assert post(url, "/spex/budget", {"k": KNEE})["scheduler"]["budget"] == KNEE
    wait_idle(url)
    before = sched(url)["counters"]
    seq0 = step_seq(url)
    futs: List[cf.Future] = []
    with cf.ThreadPoolExecutor(24) as ex:
        # 1. speculation fills an idle engine; then KNEE primaries arrive: the room is 0, speculation is off. A CI run
        # never saw all 6 live at one step when they came one HTTP request at a time
        futs += _together(ex, url, _spec("ns1s", 6, 160))
        wait_spec_step(url, seq0, 6)
        # more primaries than the knee, in one batched request so they reach the scheduler together: CI once never
        # saw KNEE of them live at one step when they came one HTTP request at a time
        phase1 = _together(ex, url, _primary("ns1", KNEE + 4, 128))
        futs += phase1
        for f in phase1:
            f.result()
        # 2. two primaries decode; speculative work arriving now must not take a prefill step from them
        wait_idle(url, timeout=300)
        phase2 = _together(ex, url, _primary("ns2", 2, 160))
        futs += phase2
        wait_running(url, 2)
        time.sleep(0.1)
        futs += _submit(ex, url, _spec("ns2s", 4, 96))
        for f in phase2:
            f.result()
        # 3. a primary arrives while speculative requests decode: admitted at once
        time.sleep(0.1)
        futs += _submit(ex, url, _primary("ns3", 1, 32))
        outs = _results(futs)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)  # none starves
    wait_idle(url, timeout=300)
    rows = step_rows(url, seq0)
    after = sched(url)["counters"]

    prefill_spec = [r for r in rows if r["mode"] in PREFILL_MODES and r["n_spec"] > 0]
    assert prefill_spec  # speculative work was admitted at all
    left_waiting = [r for r in prefill_spec if _waiting_primary(r) > 0]
    assert not left_waiting, left_waiting[:3]
    replaced_decode = [r for r in prefill_spec if r["n_primary"] == 0 and r["primary_running"] > 0]
    assert not replaced_decode, replaced_decode[:3]
    beside = [r for r in prefill_spec if r["mode"] == MIXED and r["n_primary"] > 0]
    delayed = [r for r in rows if r["mode"] == 2 and _waiting_primary(r) > 0]
    assert not delayed, delayed[:3]
    over_room = [r for r in rows if r["spec_room"] >= 0 and r["spec_total"] > r["spec_room"]]
    assert not over_room, over_room[:3]
    over_knee = [r for r in rows if r["knee"] > 0 and r["n_spec"] > 0 and r["batch_size"] > r["knee"]]
    assert not over_knee, over_knee[:3]
    over_allowance = [r for r in rows if 0 <= r["spec_prefill_credit_s"] < r["spec_prefill_cost_s"] - 1e-9]
    assert not over_allowance, over_allowance[:3]
    # speculative prompt tokens beside primaries went through the allowance: every such step charged at least
    # one admission to the bucket or to a worth (its price may be 0: a noisy host can fit a zero per-token price)
    beside_live = [
        r for r in rows if r["spec_prefill_tokens"] > 0 and r["primary_live"] > 0 and r["spec_prefill_credit_s"] >= 0
    ]  # credit -1: before any price was known
    charged = sum(
        after.get(k, 0) - before.get(k, 0) for k in ("spec_prefill_bucket", "spec_prefill_worth", "spec_prefill_free")
    )
    assert charged >= len(beside_live), (charged, beside_live[:3])
    assert after.get("spec_before_primary", 0) == before.get("spec_before_primary", 0)
    # each row carries the context its requests attend over: a decode step of an unchanged batch adds one per row
    same = [
        (a, b)
        for a, b in zip(rows, rows[1:])
        if a["mode"] == b["mode"] == 2 and b["step"] == a["step"] + 1 and a["batch_size"] == b["batch_size"]
    ]
    grew = [b["kv_tokens"] - a["kv_tokens"] == a["batch_size"] for a, b in same]
    assert same and sum(grew) >= 0.8 * len(grew), same[:3]

    # not vacuous: the knee switched speculation off (retracting it), and decode protection held some back
    at_knee = [r for r in rows if r["knee"] > 0 and r["primary_live"] >= r["knee"]]
    assert at_knee and all(r["spec_total"] == 0 for r in at_knee), at_knee[:3]
    assert after.get("spec_retracted_for_budget", 0) > before.get("spec_retracted_for_budget", 0)
    if mixed:  # phase 2's speculation was prefilled inside the primaries' decode step, nothing was held for it
        assert beside and not any(r["decode_protected"] == 1 for r in rows), beside[:3]
    else:
        assert not beside and any(r["decode_protected"] == 1 and r["spec_held"] > 0 for r in rows)
    # and back on: speculative requests decoded again after the primaries of phase 1 were gone
    last_at_knee = max(r["step"] for r in at_knee)
    assert any(r["step"] > last_at_knee and r["n_spec"] > 0 for r in rows)
    hooks = [r["hook_s"] for r in rows if r["hook_s"] is not None]
    steps = [r["step_s"] for r in rows if r["step_s"] is not None]
    print(
        f"steps {len(rows)}; spec prefills {len(prefill_spec)}; hook time {sum(hooks) * 1e3:.1f} ms over "
        f"{sum(steps):.2f} s of steps; knee {sorted({r['knee'] for r in rows})}"
    )


def test_no_speculative_prefill_beside_primaries_at_share_zero(spex_server_in_mode):
    """``spec_prefill_share`` 0: speculative requests that arrive while primaries decode wait for them (deferred,
    not dropped), then run; no step prefills a speculative prompt while a primary is live (one the live price makes
    free excepted)."""
    url = spex_server_in_mode.url
    post(url, "/spex/release", {})
    post(url, "/spex/knobs", {"spec_prefill_share": 0.0})
    try:
        wait_idle(url)
        before = sched(url)["counters"]
        seq0 = step_seq(url)
        with cf.ThreadPoolExecutor(8) as ex:
            primaries = _together(ex, url, _primary("z0", 2, 128))
            wait_running(url, 2)
            spec = _submit(ex, url, _spec("z0s", 3, 16))
            outs = _results(primaries + spec)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)  # deferred, then served
        wait_idle(url, timeout=300)
        rows = step_rows(url, seq0)
        after = sched(url)["counters"]
    finally:
        post(url, "/spex/knobs", {"spec_prefill_share": DEFAULT_SHARE})
    spec_prefill = [r for r in rows if r["spec_prefill_tokens"] > 0]
    assert spec_prefill  # the speculative requests were prefilled at all ...
    beside = [r for r in spec_prefill if r["primary_live"] > 0 or r["n_primary"] > 0]
    # ... but only once no primary was live, unless the live price in force was 0 (measured free: admitted at any
    # share, counted apart; a noisy host can fit it)
    free = after.get("spec_prefill_free", 0) - before.get("spec_prefill_free", 0)
    assert not beside or free > 0, beside[:3]
    assert after.get("spec_prefill_deferred", 0) > before.get("spec_prefill_deferred", 0) or free > 0  # not vacuous


def _fit_the_decode_line(url: str, ex: cf.Executor) -> None:
    """Decode steps at several batch sizes until the scheduler's live line is fitted (the allowance's price)."""
    for attempt in range(6):
        if requests.get(url + "/spex/stats", timeout=60).json()["batch"]["counters"]["curve_a_s"] > 0:
            return
        for n in (1, 2, 3, 4):
            for f in _submit(ex, url, _primary(f"line{attempt}n{n}", n, 24)):
                f.result()
    raise AssertionError("the live decode line was never fitted")


def _price_the_prefill(url: str, ex: cf.Executor, tokens: int) -> None:
    """Prefill beside decoding primaries until the scheduler prices a prompt token above zero (a busy host can hide
    the tiny model's prefill cost in its step-time noise; a zero price pays itself, from any bucket)."""
    for attempt in range(8):
        f, p = sched(url)["spec_prefill"]["price_f_p_s"]
        if 0 < p * tokens < float("inf"):
            return
        decoding = _together(ex, url, _primary(f"price{attempt}d", 2, 64))
        wait_running(url, 2)
        for n, size in enumerate((40, 120, 240)):
            long = [body(words(size, 300 + n), 4, f"spex:price{attempt}n{n}p0:r:", "primary")]
            for fut in _submit(ex, url, long):
                fut.result()
        for fut in decoding:
            fut.result()
    raise AssertionError(f"the prefill price stayed {sched(url)['spec_prefill']['price_f_p_s']} on this host")


def test_a_speculative_request_worth_its_price_rides_beside_primaries_at_share_zero(spex_server_in_mode):
    """The allowance's second payer: a speculative request whose search says its hit saves more than its prefill
    costs every search with live primaries (``custom_params["spex_worth_s"]``) is prefilled beside them even with
    no bucket; one worth nothing still waits."""
    url = spex_server_in_mode.url
    post(url, "/spex/release", {})
    post(url, "/spex/knobs", {"spec_prefill_share": 0.0})
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            _fit_the_decode_line(url, ex)
            _price_the_prefill(url, ex, 16)
            wait_idle(url)
            before = sched(url)["counters"]
            seq0 = step_seq(url)
            primaries = _together(ex, url, _primary("w0", 2, 128))
            wait_running(url, 2)
            worthy = _spec("w0s", 2, 16)
            for b in worthy:
                b["sampling_params"]["custom_params"]["spex_worth_s"] = 1e3
            worthless = _spec("w1s", 2, 16)
            for b in worthless:
                b["sampling_params"]["custom_params"]["spex_worth_s"] = 0.0
            spec = _submit(ex, url, worthy + worthless)
            outs = _results(primaries + spec)
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        wait_idle(url, timeout=300)
        rows = step_rows(url, seq0)
        after = sched(url)["counters"]
    finally:
        post(url, "/spex/knobs", {"spec_prefill_share": DEFAULT_SHARE})
    beside = [r for r in rows if r["spec_prefill_tokens"] > 0 and r["primary_live"] > 0]
    assert beside  # the worthy ones rode the primaries' steps ...
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    # both worthy ones paid by their worth (a retracted one pays again when it is readmitted beside primaries), or
    # went free if the live price fell to 0 meanwhile (a noisy host: then nothing pays, counted apart)
    worth, free = delta.get("spec_prefill_worth", 0), delta.get("spec_prefill_free", 0)
    assert 2 <= worth + free and worth <= 2 + delta.get("spec_retracted_for_budget", 0), delta
    assert delta.get("spec_prefill_bucket", 0) == 0, delta  # share 0: the bucket paid for nothing
    # ... the others waited, unless they went free (CI once saw 2 admissions at share 0 counted as the bucket's: a
    # price of 0 let the empty bucket pay 0, before "free" had its own payer)
    assert delta.get("spec_prefill_deferred", 0) > 0 or free > 0, delta

"""ReSpec and two SGLang request features on a real CPU server (tiny Llama, float32, spex_cpu attention, NGRAM n=4
with ``--respec-adaptive --respec-force alternate:3``), against a plain server:

* ``return_hidden_states``: a plain step reports its hidden states (one row per request) in a verify's layout,
  request i at row i*n, as SGLang reads them with the result's row stride; before, every request but the first
  got missing or another request's rows.
* penalties (frequency / presence / repetition) and ``min_new_tokens``: SGLang applies them "relaxed" under
  speculation (once per verify step), so a penalised request runs plain steps, as an opted-out one does, and its
  greedy output equals a plain server's; an unpenalised request alone still speculates.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import List, Optional

import pytest
import requests
import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from workloads import BASE, COMMON, REPEAT

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.respec.adaptive import opted_out
from sglang_spex.serve import ServerProcess

HS_TEXTS = [BASE, REPEAT, BASE + " grew", REPEAT + " a b", "Once upon a time"]  # 5 > n: rows past a neighbour's
HS_N = 12
PEN_N = 24
MIN_NEW = 12
PENALTIES = {
    "freq": {"frequency_penalty": 0.8},
    "pres": {"presence_penalty": 0.8},
    "rep": {"repetition_penalty": 1.5},
}
HS_TOL = 1e-3  # float32 on one host
# SGLang's non-overlap loop: under overlap SGLang counts a penalised request's output tokens from ``req.output_ids``
# while the previous step's result may not be processed yet, so its penalised output depends on arrival timing
# (plain server too); without overlap it is deterministic and a ReSpec server must match a plain one exactly.
NO_OVERLAP = ["--disable-overlap-schedule"]


def _port(offset: int) -> Optional[int]:
    """A fixed port from ``RESPEC_TEST_PORT_BASE`` (shared hosts), else a free one."""
    base = os.environ.get("RESPEC_TEST_PORT_BASE")
    return int(base) + offset if base else None


def _post(url: str, body: dict) -> list:
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    return out if isinstance(out, list) else [out]


def _greedy(n: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def hidden_states(url: str, custom: Optional[dict] = None) -> List[dict]:
    params = _greedy(HS_N, **({"custom_params": custom} if custom else {}))
    out = _post(url, {"text": HS_TEXTS, "sampling_params": params, "return_hidden_states": True})
    return [{"ids": x["output_ids"], "hs": x["meta_info"].get("hidden_states")} for x in out]


def penalised(url: str, stop_token: int, custom: Optional[dict] = None) -> dict:
    """Greedy ids of REPEAT under each penalty and of BASE under ``min_new_tokens`` with a stop token, one request each,
    and of a batch mixing a penalised request with an unpenalised one."""
    extra = {"custom_params": custom} if custom else {}
    out = {}
    for key, pen in PENALTIES.items():
        out[key] = _post(url, {"text": REPEAT, "sampling_params": _greedy(PEN_N, **pen, **extra)})[0]["output_ids"]
    minnew = _greedy(PEN_N, min_new_tokens=MIN_NEW, stop_token_ids=[stop_token], ignore_eos=False, **extra)
    out["minnew"] = _post(url, {"text": BASE, "sampling_params": minnew})[0]["output_ids"]
    mixed = _post(
        url,
        {
            "text": [REPEAT + " a", BASE],
            "sampling_params": [_greedy(PEN_N, **PENALTIES["freq"], **extra), _greedy(PEN_N, **extra)],
        },
    )
    out["mixed"] = [x["output_ids"] for x in mixed]
    return out


def respec_state(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=60).json()["internal_states"][0]["respec"]


def stop_token_for_min_new(url: str) -> int:
    """A token of BASE's first 12 greedy tokens that ends its generation (on a plain server) once
    ``min_new_tokens=12`` lets it: the stop token of the ``min_new_tokens`` case."""
    first = _post(url, {"text": BASE, "sampling_params": _greedy(MIN_NEW)})[0]["output_ids"]
    for token in dict.fromkeys(first):
        params = _greedy(PEN_N, min_new_tokens=MIN_NEW, stop_token_ids=[token], ignore_eos=False)
        if len(_post(url, {"text": BASE, "sampling_params": params})[0]["output_ids"]) < PEN_N:
            return token
    raise AssertionError(f"no token of {first} stops BASE after {MIN_NEW} tokens")


@pytest.fixture(scope="module")
def plain(tiny_model):
    args = ["--model-path", tiny_model, *COMMON, *NO_OVERLAP, "--enable-return-hidden-states"]
    with ServerProcess(args, port=_port(0)) as srv:
        unpen = _post(srv.url, {"text": REPEAT, "sampling_params": _greedy(PEN_N)})[0]["output_ids"]
        stop_token = stop_token_for_min_new(srv.url)
        return {"hs": hidden_states(srv.url), "pen": penalised(srv.url, stop_token), "stop": stop_token, "unpen": unpen}


@pytest.fixture(scope="module")
def respec(tiny_model, plain):  # after the plain server has stopped: one at a time
    spec = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    respec = ["--respec-adaptive", "--respec-force", "alternate:3", "--enable-return-hidden-states"]
    with ServerProcess(["--model-path", tiny_model, *COMMON, *NO_OVERLAP, *spec, *respec], port=_port(1)) as srv:
        out = {"hs_off": hidden_states(srv.url, custom={"respec": "off"}), "hs": hidden_states(srv.url)}
        before = respec_state(srv.url)
        out["pen"] = penalised(srv.url, plain["stop"])
        out["pen_state"] = respec_state(srv.url)
        out["unpen"] = _post(srv.url, {"text": REPEAT, "sampling_params": _greedy(PEN_N)})[0]["output_ids"]
        out["unpen_state"] = respec_state(srv.url)
        out["before"] = before
        return out


def _rows(hs) -> List[List[float]]:
    """One hidden-state row per output token: the prefill entry's last row (SGLang returns the prompt's rows it
    computed, which depends on its prefix cache), then one row per decode step."""
    first = hs[0][-1] if hs[0] and isinstance(hs[0][0], list) else hs[0]
    return [first, *hs[1:]]


def _assert_same_hidden(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"]
    assert len(got["hs"]) == len(want["hs"]) == len(want["ids"])
    g, w = _rows(got["hs"]), _rows(want["hs"])
    worst = max(abs(a - b) for rg, rw in zip(g, w) for a, b in zip(rg, rw, strict=True))
    assert worst <= HS_TOL, worst


def test_plain_steps_return_every_requests_hidden_states(plain, respec):
    """All steps plain (opted out): every request's hidden states equal the plain server's, one per token."""
    for got, want in zip(respec["hs_off"], plain["hs"]):
        _assert_same_hidden(got, want)


def test_switching_steps_return_one_hidden_state_per_token(plain, respec):
    """Plain and spec steps mixed: as many hidden-state entries per request as the plain server returns."""
    for got, want in zip(respec["hs"], plain["hs"]):
        assert got["ids"] == want["ids"]
        assert len(got["hs"]) == len(want["hs"]) == len(want["ids"])
        assert all(len(r) == len(_rows(want["hs"])[0]) for r in _rows(got["hs"]))


def test_penalised_requests_equal_plain_server(plain, respec):
    assert respec["pen"] == plain["pen"]
    assert MIN_NEW < len(plain["pen"]["minnew"]) < PEN_N  # the stop token ended it after min_new_tokens
    assert respec["pen_state"]["spec_steps"] == respec["before"]["spec_steps"]  # penalised batches ran plain


def test_unpenalised_request_still_speculates(plain, respec):
    assert respec["unpen"] == plain["unpen"]
    assert respec["unpen_state"]["spec_steps"] > respec["pen_state"]["spec_steps"]


def test_plain_hidden_states_in_verify_layout():
    """Unit: one row per request moves to row i*n; no hidden states, or n = 1, leave the output alone."""
    hidden = torch.arange(6, dtype=torch.float32).view(3, 2)
    out = LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)
    sw.verify_hidden_rows(out, 3, 4)
    assert out.hidden_states.shape == (12, 2)
    assert torch.equal(out.hidden_states[::4], hidden)
    one = LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)
    sw.verify_hidden_rows(one, 3, 1)
    assert one.hidden_states is hidden
    none = LogitsProcessorOutput(next_token_logits=None, hidden_states=None)
    sw.verify_hidden_rows(none, 3, 4)
    assert none.hidden_states is None


def test_penalised_batches_opt_out():
    """Unit: SGLang's penalizer state (scheduler side: the orchestrator; inside a forward: its buffers) opts the
    batch out of speculation, as ``custom_params={"respec": "off"}`` does."""

    def batch(required=None, additive=None, scaling=None, custom=None, processor=False):
        orchestrator = None if required is None else SimpleNamespace(is_required=required)
        info = SimpleNamespace(
            penalizer_orchestrator=orchestrator,
            acc_additive_penalties=additive,
            acc_scaling_penalties=scaling,
            has_custom_logit_processor=processor,
        )
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom))
        return SimpleNamespace(sampling_info=info, reqs=[req])

    assert not opted_out(batch(required=False)) and not opted_out(batch())
    assert opted_out(batch(required=True))
    assert opted_out(batch(additive=torch.zeros(1, 4))) and opted_out(batch(scaling=torch.ones(1, 4)))
    assert opted_out(batch(required=False, custom={"respec": "off"}))
    assert opted_out(batch(required=False, processor=True))  # eagle_sample never calls a custom logit processor
    assert not opted_out(SimpleNamespace(sampling_info=None, reqs=[]))

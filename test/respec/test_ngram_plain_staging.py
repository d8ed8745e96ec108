"""ReSpec's NGRAM plain step on a GPU: it copies the previous step's accepted tokens to the host *before* it launches
the forward, and it says once that its target runs without CUDA graphs.

SGLang's NGRAM worker stages them before its verify forward (``_prepare_draft_tokens``): on a GPU under the overlap
scheduler a host copy after the launch waits for that forward, and the scheduler loses its overlap. On CPU the forward
has finished when it returns, so only the order shows it. The real step is covered on a server by
``test_adaptive_server.py`` (greedy output unchanged across switches, both scheduler modes).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch

from sglang_spex.adapters import spec_workers as sw
from sglang_spex.respec.ngram_plain import note_eager_off_steps, plain_decode_step

N = 3  # the worker's draft_token_num: accepted tokens per request, flat


class _Recorded(torch.Tensor):
    """A tensor whose host copies are logged."""

    log: List[str]

    def cpu(self, *args, **kwargs):
        type(self).log.append("host copy")
        return super().cpu(*args, **kwargs)


def _worker_and_batch(log: List[str]):
    _Recorded.log = log
    tokens = torch.tensor([11, 12, 0, 21, 0, 0], dtype=torch.int32).as_subclass(_Recorded)
    lens = torch.tensor([2, 1], dtype=torch.int32).as_subclass(_Recorded)
    batch = SimpleNamespace(
        reqs=[object(), object()],
        seq_lens=torch.tensor([7, 5]),
        spec_info=SimpleNamespace(accept_tokens=tokens, accept_lens=lens),
        grammar_needs_sync=lambda: False,
    )
    fed = []
    worker = SimpleNamespace(
        draft_token_num=N,
        enable_overlap=True,
        _update_ngram_corpus=lambda b: fed.append((list(worker.prev_token_ids), list(worker.prev_accept_lens))),
    )
    return worker, batch, fed


def test_the_host_copy_comes_before_the_forward_and_the_corpus_gets_the_staged_tokens(monkeypatch):
    log: List[str] = []
    worker, batch, fed = _worker_and_batch(log)

    def forward(w, b, last):
        log.append("forward")
        assert last.tolist() == [12, 21]  # the last accepted token of each request
        return SimpleNamespace(next_token_ids=torch.tensor([13, 22]))

    monkeypatch.setattr(sw, "plain_decode_forward", forward)
    monkeypatch.setattr(sw, "ngram_result", lambda w, target, toks, lens, seq: (toks.tolist(), lens.tolist(), seq))
    published = []
    toks, lens, seq = plain_decode_step(worker, batch, published.append)
    assert log.index("forward") > max(i for i, e in enumerate(log) if e == "host copy"), log
    assert fed == [([11, 12, 0, 21, 0, 0], [2, 1])]  # staged before, fed after: the previous step's tokens
    assert toks == [13, 0, 0, 22, 0, 0] and lens == [1, 1] and seq.tolist() == [8, 6]
    assert published[0].tolist() == [8, 6]


def test_without_overlap_nothing_is_copied_and_the_corpus_reads_output_ids(monkeypatch):
    log: List[str] = []
    worker, batch, fed = _worker_and_batch(log)
    worker.enable_overlap = False
    monkeypatch.setattr(sw, "plain_decode_forward", lambda w, b, last: SimpleNamespace(next_token_ids=last + 1))
    monkeypatch.setattr(sw, "ngram_result", lambda *a: None)
    plain_decode_step(worker, batch)
    assert fed == [([], [0, 0])] and "host copy" not in log


def test_an_off_step_on_a_graph_replaying_target_warns_once(caplog):
    """A target with CUDA graphs (a GPU) runs ReSpec's NGRAM off steps eagerly: said once per worker, at the first
    off step; a target without graphs (CPU) says nothing."""
    gpu = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(decode_cuda_graph_runner=object()))
    )
    cpu = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(decode_cuda_graph_runner=None)))
    with caplog.at_level("WARNING", logger="sglang_spex.respec.ngram_plain"):
        assert [note_eager_off_steps(gpu), note_eager_off_steps(gpu), note_eager_off_steps(cpu)] == [True, False, False]
    assert sum("without CUDA graphs" in r.getMessage() for r in caplog.records) == 1

"""Hook V2: the overlap relay's row gather on CPU equals SGLang's definition (``buf[indices]`` per buffer)."""

from __future__ import annotations

import pytest
import torch

from sglang_spex.srt.cpu_overlap import gather_rows_cpu, v2_gather_spec_extras


def _bufs(rows: int = 7, with_hidden: bool = True):
    g = torch.Generator().manual_seed(0)
    return (
        torch.rand(rows, 4, generator=g),
        torch.randint(0, 100, (rows, 4), generator=g),
        torch.randint(0, 100, (rows,), generator=g),
        torch.rand(rows, 16, generator=g, dtype=torch.float32).to(torch.bfloat16) if with_hidden else None,
    )


@pytest.mark.parametrize("with_hidden", [True, False])
def test_gather_takes_the_indexed_rows_of_every_buffer(with_hidden):
    bufs = _bufs(with_hidden=with_hidden)
    idx = torch.tensor([5, 0, 5, 3], dtype=torch.int32)
    out = gather_rows_cpu(idx, *bufs)
    for got, buf in zip(out, bufs):
        if buf is None:
            assert got is None
        else:
            assert got.dtype == buf.dtype and torch.equal(got, buf[idx.long()])


def test_empty_indices_give_empty_rows():
    out = gather_rows_cpu(torch.empty(0, dtype=torch.int64), *_bufs())
    assert [t.shape[0] for t in out] == [0, 0, 0, 0]


def test_v2_gathers_cpu_tensors_itself_and_passes_other_devices_through():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "sglang"

    bufs = _bufs()
    idx = torch.tensor([1, 2])
    out = v2_gather_spec_extras(original, idx, *bufs)
    assert calls == [] and torch.equal(out[2], bufs[2][idx])
    out = v2_gather_spec_extras(original, indices=idx, topk_p_buf=bufs[0], topk_index_buf=bufs[1],
                                output_tokens_buf=bufs[2], hidden_states_buf=None)  # fmt: skip
    assert calls == [] and out[3] is None
    meta = torch.empty(2, dtype=torch.int64, device="meta")
    assert v2_gather_spec_extras(original, meta, *bufs) == "sglang" and len(calls) == 1

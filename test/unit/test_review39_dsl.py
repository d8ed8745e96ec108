"""Review 39 of the search DSL: ``Program.from_json`` names the field of any bad text, and the blocking ``run`` /
``run_batch`` inside a running event loop point to their async variants (no server)."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

import sglang_spex.lang as tot
from sglang_spex.tot.search_spec import SearchSpecError


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"seed": ' + "[" * 100000 + "]" * 100000 + "}",  # past the JSON decoder's recursion
        '{"seed": ' + "[" * 200 + "]" * 200 + "}",  # past MAX_JSON_DEPTH, inside the decoder's reach
    ],
)
def test_from_json_names_the_spec_field(text):
    with pytest.raises(SearchSpecError) as e:
        tot.Program.from_json(text)
    assert e.value.field == "spec"


def test_from_json_still_reads_a_program_and_names_inner_fields():
    prog = tot.Program().policy(tot.rebase(width=4))
    assert tot.Program.from_json(prog.to_json()).spec().to_dict() == prog.spec().to_dict()
    with pytest.raises(SearchSpecError) as e:
        tot.Program.from_json('{"policy": {"name": "rebase", "width": "wide"}}')
    assert e.value.field == "policy.width"


@pytest.mark.parametrize("method, async_name", [("run", "arun"), ("run_batch", "arun_batch")])
def test_blocking_runs_inside_a_running_loop_point_to_the_async_variant(method, async_name):
    prog = tot.Program()
    arg = "q" if method == "run" else ["q"]

    async def inside():
        getattr(prog, method)(arg, "http://127.0.0.1:9")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=f"await program.{async_name}"):
            asyncio.run(inside())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]  # no coroutine was made

"""The profiler's batch sweep extends until throughput flattens (synthetic step-time curves, no server)."""

from __future__ import annotations

import asyncio

import pytest

from sglang_spex.profile.measure import ProfileSpec, filler_tokens_per_word, measure_profile, sweep_limit
from sglang_spex.profile.roofline import find_knee, next_batch, throughput_gain
from sglang_spex.tot.engine import EnginePort, GenResult
from sglang_spex.tot.validation import FieldError

START = [1, 2, 4, 8, 16, 32]


def sweep(curve, limit=512, start=START):
    """Run the sweep rule against ``curve(B) -> seconds per step``: (batches, times)."""
    sizes, times = list(start), [curve(b) for b in start]
    while (b := next_batch(sizes, times, limit)) is not None:
        sizes.append(b)
        times.append(curve(b))
    return sizes, times


@pytest.mark.parametrize("knee", [48.0, 100.0, 200.0])
def test_knee_past_the_initial_sizes_is_found(knee):
    def roof(b):
        return max(0.010, 0.010 / knee * b)

    old = find_knee(START, [roof(b) for b in START])
    assert not old.bounded and old.knee == 32  # the old fixed sweep: knee reported at its last batch
    sizes, times = sweep(roof)
    assert sizes[: len(START)] == START and max(sizes) > knee
    assert throughput_gain(sizes, times) < 1.1  # stopped because throughput flattened
    fit = find_knee(sizes, times)
    assert fit.bounded and fit.knee == pytest.approx(knee, rel=0.05)


def test_knee_inside_the_initial_sizes_adds_at_most_what_flattening_needs():
    def roof(b):
        return max(0.010, 0.010 / 6 * b)

    sizes, _ = sweep(roof)
    assert sizes == START  # 16 -> 32 already gained nothing


def test_linear_cpu_curve_stops_once_doubling_gains_under_ten_percent():
    def line(b):
        return 0.050 + 0.0042 * b  # knee a/b ≈ 12

    sizes, times = sweep(line)
    gains = [throughput_gain(sizes[: i + 1], times[: i + 1]) for i in range(1, len(sizes))]
    assert gains[-1] < 1.1 and all(g >= 1.1 for g in gains[:-1])
    assert find_knee(sizes, times).knee == pytest.approx(0.050 / 0.0042, rel=0.1)


def test_sweep_respects_the_limit():
    def flat(b):
        return 0.01  # memory-bound everywhere: throughput grows forever

    sizes, _ = sweep(flat, limit=100)
    assert max(sizes) == 100 and sizes[-2:] == [64, 100]
    assert next_batch([1, 2], [0.01, 0.01], limit=2) is None


def test_sweep_limit_takes_max_running_requests():
    spec = ProfileSpec(max_batch=512)
    assert sweep_limit(spec, {"flags": {"max_running_requests": 48}}) == 48
    assert sweep_limit(spec, {"flags": {"max_running_requests": None}}) == 512
    assert sweep_limit(ProfileSpec(batch_sizes=(1, 2, 4), max_batch=2), {}) == 4  # never below the given sizes


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"batch_sizes": (1, 49)}, "batch_sizes[1]"),
        ({"ctx_batch": 0}, "ctx_batch"),
        ({"short_tokens": 20, "long_tokens": 20}, "long_tokens"),
        ({"short_tokens": 0}, "short_tokens"),
        ({"long_tokens": 2020}, "long_tokens"),  # 2020 + a prompt's 32 > 2048
        ({"ctx_prefix_words": 999}, "ctx_prefix_words"),  # (2048 - 20 - 32) // 2 = 998 words fit
        ({"prefill_words": -1}, "prefill_words"),
    ],
)
def test_spec_check_names_the_field_past_the_engine(fields, field):
    with pytest.raises(FieldError) as e:
        ProfileSpec(**fields).check(max_batch=48, context_len=2048)
    assert e.value.field == field
    ProfileSpec(batch_sizes=(1, 48), ctx_prefix_words=998, prefill_words=998).check(48, 2048)  # the edges pass
    with pytest.raises(FieldError, match="0..285"):  # a tokenizer that spends 7 tokens on a word: (2048-52) // 7
        ProfileSpec(prefill_words=300).check(48, 2048, tokens_per_word=7)


def test_filler_tokens_per_word_reads_the_tokenizer():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return list(text)

    assert filler_tokens_per_word(Chars()) == len(" lambda")
    assert filler_tokens_per_word(None) == 2  # no tokenizer: the default


class VirtualClock:
    """Stands in for the ``time`` module of the profiler: time moves only when the port says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class RooflinePort(EnginePort):
    """Concurrent requests form one batch that takes max(base, base·B/knee) per decode step, in virtual time."""

    def __init__(self, clock: VirtualClock, knee: float, base: float = 0.002):
        self.clock, self.knee, self.base, self.live = clock, knee, base, 0

    async def generate(self, req):
        start = self.clock.now
        self.live += 1
        await asyncio.sleep(0)  # every request of the gather() has joined the batch
        batch = self.live
        await asyncio.sleep(0)
        self.clock.now = max(self.clock.now, start + req.max_new_tokens * max(self.base, self.base * batch / self.knee))
        self.live -= 1
        return GenResult(rid=req.rid, text="x", output_ids=[0] * req.max_new_tokens, finish_reason="length")

    async def abort(self, rid_or_prefix):
        pass


def test_measure_profile_extends_its_sweep_on_a_port(monkeypatch):
    import sglang_spex.profile.measure as measure

    clock = VirtualClock()
    monkeypatch.setattr(measure, "time", clock)
    spec = ProfileSpec(
        batch_sizes=(1, 4, 16), short_tokens=2, long_tokens=6, ctx_prefix_words=0, prefill_words=0, repeats=1
    )
    prof = asyncio.run(measure_profile(RooflinePort(clock, knee=40), {"model": "m", "hardware": "h"}, spec, False))
    assert prof.batch_sizes[:3] == [1, 4, 16] and max(prof.batch_sizes) > 40
    assert prof.fit.bounded and prof.fit.knee == pytest.approx(40, rel=0.1)


def test_throughput_gain_is_per_doubling_whatever_the_sweeps_last_step():
    """21 % more throughput over a 4x step is 10 % per doubling (a user's sweep (8, 32) is judged as (8, 16, 32))."""
    assert throughput_gain([8, 32], [0.1, 0.1 * 4 / 1.21]) == pytest.approx(1.1)

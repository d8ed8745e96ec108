"""check_on_policy's statistics: the homogeneity test on token tuples, the reward gap and its standard error."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from check_on_policy import homogeneity_pvalue, reward_gap  # noqa: E402


def test_homogeneity_separates_a_shifted_distribution_and_pools_rare_cells():
    rng = np.random.default_rng(0)
    cats = [(1, 2), (1, 3), (4, 5), (6, 7)]
    same_a = [cats[i] for i in rng.choice(4, 2000, p=[0.4, 0.3, 0.2, 0.1])]
    same_b = [cats[i] for i in rng.choice(4, 2000, p=[0.4, 0.3, 0.2, 0.1])]
    shifted = [cats[i] for i in rng.choice(4, 2000, p=[0.3, 0.4, 0.2, 0.1])]
    assert homogeneity_pvalue(same_a, same_b) > 1e-3
    assert homogeneity_pvalue(same_a, shifted) < 1e-6
    rare = [(9, i) for i in range(5)]  # five singletons in each arm: one pooled cell, not five
    assert homogeneity_pvalue([(1, 2)] * 50 + rare, [(1, 2)] * 50 + [(8, i) for i in range(5)]) == pytest.approx(1.0)
    assert homogeneity_pvalue([(1, 2)] * 10, [(1, 2)] * 10) == 1.0  # one cell: nothing to compare


def test_reward_gap_and_its_standard_error():
    got = reward_gap([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0])
    assert got["base"] == 0.5 and got["other"] == 0.75 and got["gap"] == 0.25
    assert got["se"] == pytest.approx(math.sqrt(0.25 / 4 + 0.1875 / 4))


def test_the_two_servers_get_disjoint_seeds():
    from check_on_policy import SEED_BLOCK, SERVERS, request_params, request_seeds

    questions, samples = 3, 1500
    per = [{s for q in range(questions) for s in request_seeds(k, q, samples)} for k in range(len(SERVERS))]
    assert len(per[0]) == len(per[1]) == questions * samples  # no seed twice on one server
    assert not per[0] & per[1]  # none shared between the servers: independent samples
    assert max(per[1]) < 2 * SEED_BLOCK < 2**31
    seeded = request_params("seeded", 1, 2, 3, 16)
    assert [p["sampling_seed"] for p in seeded] == [SEED_BLOCK + 2 * 7919 + i for i in range(3)]
    assert seeded[0]["temperature"] == 1.0 and seeded[0]["max_new_tokens"] == 16
    assert request_params("logprobs", 0, 0, 2, 16)[1]["sampling_seed"] == 1
    assert request_params("unseeded", 1, 2, 3, 16) == {"temperature": 1.0, "max_new_tokens": 16}

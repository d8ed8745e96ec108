"""Prompt sets shared by the real-server ReSpec tests (speculative vs plain greedy comparisons)."""

BASE = "The history of the old harbour town begins with a small settlement near the river, where farmers"
REPEAT = "a b c a b c a b c a b c a b c a b c"
WORKLOADS = {
    "b1": [BASE],
    "b4_mixed": [BASE + " grew", REPEAT, "Hi", BASE + " sang in winter"],
    "b2_repetitive": [REPEAT, REPEAT + " a b"],
}
N = 24  # new tokens per request

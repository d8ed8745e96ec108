"""ReSpec online learner: EAGLE-3 drafter, training-time test, reward-weighted KD, replay buffer, async learner,
``/respec/*`` routes and the hot-swap client (see docs in each module)."""

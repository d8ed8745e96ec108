"""Online learner: rollouts go into a replay buffer; every ``update_interval`` posted batches (RL steps) the
drafter is updated with (reward-weighted) KD on a copy, checked, and published as a new version.

- variants: ``frozen`` (never update), ``unweighted`` (KD, w = 1), ``reward`` (reward-weighted KD, see kd.py; the
  weight rule is ``weight_mode``: the constructor's argument when given, else the config's);
- modes: ``sync`` (``submit`` returns after the update it made due; concurrent submits' updates run one at a time,
  in order, each from the drafter the one before published) or ``async`` (``submit`` returns at once; updates due
  while one runs are coalesced into one follow-up update). Either way updates run on the learner's one worker
  thread (started while updates are queued): however many sync submits wait, one thread trains, and
  ``submit_nowait`` lets a caller (the route) wait for its update without holding a thread of its own;
  ``state()["updating"]`` is true while an update runs or waits to run, in either mode;
- a candidate is rolled back (never published; the old version keeps serving) on a non-finite loss or weight,
  on an acceptance collapse on the held-out probe (accepted draft tokens after < ``collapse_ratio`` × before),
  or when publishing fails;
- replicas: a publisher that feeds several (``hotswap.ReplicaPublisher``) returns each replica's outcome; the
  version is published once one replica took it, and the record names the replicas that failed (they keep their
  old drafter); ``state()["replicas"]`` is each replica's drafter version;
- an update drains the buffer and trains on ``train_steps`` micro-batches of ``micro_batch`` rollouts drawn from
  it; the policy copy runs only on the rollouts drawn (at most ``train_steps x micro_batch``), so an update's time
  and memory do not grow with what was posted; the reward weights are normalised over every drained rollout. An
  update whose drawn rollouts all weigh 0 (e.g. ``linear`` with no positive reward in the drained batch) trains
  and publishes nothing (reason ``zero_weight``; ``state()["zero_weight_updates"]`` counts them). A rollout longer
  than ``train_window`` tokens trains on a window of that many (``_window``), its features computed with the
  context before it, so memory does not grow with rollout length either. A rollout longer than the model's context
  (``max_rollout_tokens``: prompt + response) is refused at ``submit``;
- KD target p: when every rollout the update trains on carries the served target's top-k log-probs
  (``target_top_logprobs``) and ``kd_target="auto"`` (default), p is that top-k renormalised over the draft
  vocabulary (``target.served_target``; ``target_source="served"``); otherwise — a mixed batch included — p comes
  from the policy copy's logits for the whole batch (``"copy"``). The copy runs either way: the drafter's input
  features (the aux hidden states) only come from it. ``target_logp_gap`` is the mean |copy − served| log p of the
  sampled tokens that carry a served log-prob (``target_logprobs``, else their top-k entry): a stale copy shows;
- idle: when the server's adaptive plan could never serve a drafter (no profiled config beats plain decode even at
  full acceptance: ``adaptive.drafter_never_pays``, set as ``idle_reason`` by the routes), due updates are skipped
  and counted (``skipped_updates``); rollouts are still stored;
- payback: with ``best_speedup`` set (the routes: the profile's best case at full acceptance, ``adaptive.best_case``)
  and ``config.payback`` on, a due update is skipped (counted) when the last updates took longer than the most
  speculation could save over one update interval: (1 − 1/best_speedup) × the interval's wall time (the median gap
  between submits × ``update_interval``, an upper bound on its decode time). The gate is re-read at every due point
  (``state()["payback"]``); a learner coming back trains from the due point after (so the caller can sync its policy
  copy and send log-probs again first). ``submit`` says ``training``: whether updates currently run, so an RL loop can
  skip the log-probs and policy pushes only an update would use;
- history: the last ``HISTORY_LEN`` update records (``history``, ``state()["updates"]``; ``attempts`` counts them
  all), read under the lock the async worker appends under;
- timing: a record's ``seconds`` is the update's duration; the time ``submit`` blocked its caller (the RL loop's
  stall: validation, plus the whole update in sync mode) is ``state()``'s ``last/max/total_submit_seconds``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple, Union

import torch

from sglang_spex.config import LearnerConfig
from sglang_spex.respec.buffer import ReplayBuffer, Rollout
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.kd import WEIGHT_MODES, reward_weighted_kd, reward_weights
from sglang_spex.respec.target import Batch, sampled_logp_gap, served_target
from sglang_spex.respec.ttt import acceptance_length

Sequences = Sequence[Tuple[Sequence[int], Sequence[int]]]
FeatureFn = Callable[..., Batch]  # (sequences, windows=...) -> Batch, as ``TargetFeatures.batch``
PublishFn = Callable[[int, List[Tuple[str, torch.Tensor]]], Optional[dict]]  # a dict: per-replica outcomes
PolicySyncFn = Callable[[List[Tuple[str, torch.Tensor]]], int]
KD_TARGETS = ("auto", "copy")
HISTORY_LEN = 256  # update records kept (``history``, ``state()["updates"]``); a long RL run posts one per step
POLICY_VALUE_BYTES = 8  # the widest dtype a policy push may carry (float64; ``policy_wire.check_tensors``)
POLICY_TENSOR_FRAMING = 64 << 10  # bytes of pickle/zip or safetensors framing allowed per tensor of a policy push

logger = logging.getLogger(__name__)


class NoPolicyCopyError(RuntimeError):
    """``set_policy`` on a learner without a policy copy."""


class StalePolicyError(ValueError):
    """``set_policy`` with a version at or below the one the copy holds."""


@dataclass
class UpdateRecord:
    attempt: int
    version_before: int
    version_after: int
    outcome: str  # "published" | "rolled_back"
    reason: str  # "" | "empty_buffer" | "zero_weight" (every trained rollout weighs 0) | "nan_loss" | "nan_weights"
    # | "acceptance_collapse" | "publish_failed: ..." | "error: ..."
    rollouts: int  # drained from the buffer (their rewards normalise the weights)
    tokens: int  # the update trained on: its rollouts (at most train_steps x micro_batch), windowed (train_window)
    losses: List[float]
    acceptance_before: Optional[float]
    acceptance_after: Optional[float]
    seconds: float
    replicas: Optional[List[dict]] = None  # the publisher's per-replica outcomes (ReplicaPublisher), else None
    target_source: str = ""  # "served" (the server's top-k log p) | "copy" (the policy copy's logits) | "" (none)
    target_logp_gap: Optional[float] = None  # mean |copy − served| log p of the sampled tokens (None: none served)
    served_masked: int = 0  # trained positions without a draft-vocabulary token in their served top-k (no target)


def _json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


class OnlineLearner:
    """Owns the served drafter version; ``submit`` is what ``POST /respec/rollouts`` calls."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        features: FeatureFn,
        config: Optional[LearnerConfig] = None,
        probe: Optional[Sequences] = None,
        publish: Optional[PublishFn] = None,
        policy_sync: Optional[PolicySyncFn] = None,
        weight_mode: Optional[str] = None,
        kd_target: str = "auto",
        max_rollout_tokens: Optional[int] = None,
    ):
        """``max_rollout_tokens``: the most tokens (prompt + response) a rollout may have; default the drafter's
        ``max_position_embeddings`` (the routes pass the served model's context)."""
        self.config = (config or LearnerConfig()).validate()
        if weight_mode is not None and weight_mode not in WEIGHT_MODES:
            raise ValueError(f"unknown weight mode {weight_mode!r}; choose from {WEIGHT_MODES}")
        if kd_target not in KD_TARGETS:
            raise ValueError(f"unknown KD target {kd_target!r}; choose from {KD_TARGETS}")
        self.kd_target = kd_target
        self.weight_mode = weight_mode or self.config.weight_mode
        self.policy_sync = policy_sync
        self.policy_version: Optional[int] = None
        self.features = features
        self.probe = list(probe) if probe else []
        self.publish = publish
        self.buffer = ReplayBuffer(
            self.config.buffer_capacity,
            vocab_size=drafter.cfg.vocab_size,
            max_len=max_rollout_tokens or drafter.cfg.max_position_embeddings,
            max_entries=self.config.buffer_entries,
        )
        self._drafter = drafter.eval()
        self._version = 0
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()  # one update at a time, drain to publish
        self._policy_lock = threading.Lock()  # a policy push's version check, copy and version, together
        self._idle = threading.Event()
        self._idle.set()
        self._waiting: Deque[Future] = deque()  # sync mode: one update each, in order, for a caller waiting on it
        self._pending = False  # async mode: one (coalesced) update due
        self._thread: Optional[threading.Thread] = None  # the worker, while updates are queued or running
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self.steps = 0
        self.attempts = 0
        self.idle_reason: Optional[str] = None  # set: updates are skipped (adaptive.drafter_never_pays)
        self.skipped_updates = 0
        self.zero_weight_updates = 0  # updates skipped because every rollout they drew weighs 0
        self.best_speedup: Optional[float] = None  # the profile's best case at full acceptance (payback gate)
        self.payback: Optional[dict] = None  # the payback gate's last reading (None: not applied)
        self._paying = True  # the gate's last verdict
        self._submit_times: deque = deque(maxlen=9)
        self.history: Deque[UpdateRecord] = deque(maxlen=HISTORY_LEN)  # the most recent updates, oldest first
        self.max_submit_seconds = 0.0
        self.last_submit_seconds = 0.0
        self.total_submit_seconds = 0.0

    # -- serving side ---------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def current(self) -> Tuple[int, Eagle3Drafter]:
        """(version, drafter) as one consistent pair; the drafter object is never mutated after publication."""
        with self._lock:
            return self._version, self._drafter

    def submit(self, payloads: Sequence, more: bool = False) -> dict:
        """Validate and store one batch of rollouts (raises RolloutError, storing nothing, on a bad payload);
        trigger an update when due. Async mode returns without waiting for the update; sync mode after it (run on
        the learner's worker thread). ``more``: a part of an RL step whose last part follows (stored; the step is
        counted, and an update triggered, at the last part)."""
        return self.submit_nowait(payloads, more).result()

    def submit_nowait(self, payloads: Sequence, more: bool = False) -> "Future[dict]":
        """:meth:`submit` without the wait: validates and stores in the caller's thread (raises RolloutError) and
        returns a Future of submit's answer, done at once unless a sync-mode update is due, else done once the
        learner's worker ran that update (its answer then says the version after it). The update runs even if
        the Future is cancelled."""
        t0 = time.perf_counter()
        n = self.buffer.add_batch(payloads)
        due = False
        answer: Future = Future()
        with self._lock:
            if more:
                answer.set_result(self._answer(n, due))
                return answer
            self.steps += 1
            self._submit_times.append(time.monotonic())
            if self.config.variant != "frozen" and self.steps % self.config.update_interval == 0:
                pays = self._pays_back()
                due = self.idle_reason is None and pays and self._paying  # back from the gate: next due point
                self._paying = pays
                self.skipped_updates += 0 if due else 1
        if not (due and self.config.mode == "sync"):
            if due:
                self._schedule(None)
            answer.set_result(self._submitted(t0, n, due))
            return answer

        def answer_after(update: Future) -> None:  # (in the worker, right after the update)
            try:
                update.result()
                _resolve(answer, self._submitted(t0, n, due))
            except BaseException as e:
                _resolve(answer, error=e)

        update: Future = Future()
        update.add_done_callback(answer_after)
        self._schedule(update)
        return answer

    def _submitted(self, t0: float, accepted: int, due: bool) -> dict:
        """Record how long the submit blocked its caller (since ``t0``) and answer it."""
        blocked = time.perf_counter() - t0
        with self._lock:
            self.last_submit_seconds = blocked
            self.total_submit_seconds += blocked
            self.max_submit_seconds = max(self.max_submit_seconds, blocked)
        return self._answer(accepted, due)

    def _answer(self, accepted: int, due: bool) -> dict:
        size = len(self.buffer)
        return {
            "accepted": accepted,
            "buffer_size": size,
            "version": self._version,
            "update_due": due,
            "training": self.training,
        }

    @property
    def training(self) -> bool:
        """Whether updates run (not frozen, not idle, the payback gate's last verdict)."""
        return self.config.variant != "frozen" and self.idle_reason is None and self._paying

    def _pays_back(self) -> bool:
        """The payback gate (see the module docstring); True where it does not apply. Called under the lock."""
        trained = [r.seconds for r in self.history if r.rollouts and r.reason not in ("empty_buffer", "zero_weight")][
            -3:
        ]
        times = list(self._submit_times)
        if not self.config.payback or self.best_speedup is None or not trained or len(times) < 2:
            self.payback = None
            return True
        interval = statistics.median(b - a for a, b in zip(times, times[1:])) * self.config.update_interval
        cost = statistics.median(trained)
        saving = max(0.0, 1.0 - 1.0 / self.best_speedup) * interval if self.best_speedup > 0 else 0.0
        self.payback = {
            "update_seconds": cost,
            "saving_bound_seconds": saving,
            "interval_seconds": interval,
            "best_speedup": self.best_speedup,
            "pays": cost <= saving,
        }
        return cost <= saving

    def set_policy(self, version: int, named: List[Tuple[str, torch.Tensor]]) -> int:
        """The RL trainer pushed new policy weights: later updates distill from them (the KD target moves with the
        policy). Returns the number of tensors loaded. Raises :class:`NoPolicyCopyError` without a policy copy,
        :class:`StalePolicyError` (copy unchanged) for a version at or below the current one; the check, the copy
        and the new version happen under one lock."""
        if self.policy_sync is None:
            raise NoPolicyCopyError("this learner has no policy copy to update")
        with self._policy_lock:
            if self.policy_version is not None and version <= self.policy_version:
                raise StalePolicyError(
                    f"policy version {version} is not newer than the copy's version {self.policy_version}"
                )
            n = self.policy_sync(named)
            self.policy_version = version
        return n

    def policy_max_bytes(self) -> Optional[int]:
        """The largest policy push body this learner's copy can take: every value of its state dict as float64,
        base64-encoded, with ``POLICY_TENSOR_FRAMING`` bytes per tensor and 1 MiB more; None where the copy's
        model is not found (``policy_sync`` not a bound ``load_weights`` of an object with a ``model``), 0 without
        a policy copy."""
        if self.policy_sync is None:
            return 0
        model = _bound_model(self.policy_sync)
        if model is None:
            return None
        state = model.state_dict()
        raw = sum(t.numel() for t in state.values()) * POLICY_VALUE_BYTES + len(state) * POLICY_TENSOR_FRAMING
        return raw * 4 // 3 + (1 << 20)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until no update is running or queued (tests, shutdown)."""
        return self._idle.wait(timeout)

    def state(self) -> dict:
        """JSON-safe summary (non-finite numbers, e.g. a diverged update's losses, become None)."""
        return _json_safe(self._state())

    def _state(self) -> dict:
        with self._lock:  # the async worker appends to the (bounded) history: read a snapshot
            history = list(self.history)
        last = history[-1] if history else None
        losses = [r.losses[-1] for r in history if r.losses and math.isfinite(r.losses[-1])]
        return {
            "version": self.version,
            "variant": self.config.variant,
            "mode": self.config.mode,
            "weight_mode": "none" if self.config.variant == "unweighted" else self.weight_mode,
            "kd_target": self.kd_target,
            "update_interval": self.config.update_interval,
            "steps": self.steps,
            "policy_version": self.policy_version,
            "buffer_size": len(self.buffer),
            "rollouts_received": self.buffer.total_added,
            "rollouts_dropped": self.buffer.dropped,  # oldest, past buffer_capacity or buffer_entries before an update
            "max_post_bytes": self.config.max_post_bytes,  # the largest POST /respec/rollouts body (413 past it)
            "updating": not self._idle.is_set(),
            "idle_reason": self.idle_reason,
            "skipped_updates": self.skipped_updates,
            "zero_weight_updates": self.zero_weight_updates,  # due updates whose drawn rollouts all weighed 0
            "training": self.training,
            "payback": self.payback,
            "last_loss": losses[-1] if losses else None,
            "last_update": asdict(last) if last else None,
            "attempts": self.attempts,  # every update so far; ``updates`` lists the last HISTORY_LEN
            "updates": [
                {
                    "attempt": r.attempt,
                    "version": r.version_after,
                    "outcome": r.outcome,
                    "reason": r.reason,
                    "acceptance_before": r.acceptance_before,
                    "acceptance_after": r.acceptance_after,
                    "seconds": r.seconds,
                    "target_source": r.target_source,
                    "target_logp_gap": r.target_logp_gap,
                }
                for r in history
            ],
            "max_submit_seconds": self.max_submit_seconds,
            "last_submit_seconds": self.last_submit_seconds,
            "total_submit_seconds": self.total_submit_seconds,
            "replicas": self.publish.status() if hasattr(self.publish, "status") else None,
        }

    # -- updates --------------------------------------------------------------------------------------------------
    def _schedule(self, waiter: Optional[Future]) -> None:
        """Queue an update on the worker thread (started when none runs); ``updating`` is true until the queue is
        empty. ``waiter`` (sync mode): one update of its own, in order, whose record (or error) it gets; None
        (async mode): one update due, coalesced with any other queued."""
        with self._lock:
            if waiter is None:
                self._pending = True
            else:
                self._waiting.append(waiter)
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="respec-learner", daemon=True)
                try:
                    self._thread.start()
                except BaseException:  # no thread to be had: the job is dropped, the learner as it was before
                    self._thread = None
                    if waiter is None:
                        self._pending = False
                    else:
                        self._waiting.remove(waiter)
                    if not self._waiting and not self._pending:
                        self._idle.set()
                    raise

    def _next_job(self) -> Union[Future, bool, None]:
        """The worker's next update: a waiter's, else True for a pending async one; None (the worker ends, the
        learner is idle) when nothing is queued."""
        with self._lock:
            if self._waiting:
                return self._waiting.popleft()
            if self._pending:
                self._pending = False
                return True
            self._thread = None
            self._idle.set()
            return None

    def _worker(self) -> None:
        job = self._next_job()
        while job is not None:
            record: Any = None
            error: Optional[BaseException] = None
            try:
                record = self._update_once(record_empty=isinstance(job, Future))
            except BaseException as e:  # (``_update_locked`` keeps a training error in its record: not expected)
                error = e
            following = self._next_job()  # first: a waiter answered sees ``updating`` as it is after its update
            if isinstance(job, Future):
                _resolve(job, record, error)
            elif error is not None:
                logger.error("respec: an update failed outside its record", exc_info=error)
            job = following

    def _update_once(self, record_empty: bool = True) -> Optional[UpdateRecord]:
        """Drain, train and publish, one update at a time (``_update_lock``): each starts from the drafter and
        version the one before left. ``record_empty`` False (an async update): an empty buffer is no attempt and
        leaves no record (the update before drained these rollouts between their submit's store and its
        scheduling)."""
        with self._update_lock:
            return self._update_locked(record_empty)

    def _update_locked(self, record_empty: bool = True) -> Optional[UpdateRecord]:
        rollouts = self.buffer.drain()
        if not rollouts and not record_empty:
            return None
        with self._lock:
            self.attempts += 1
            attempt, version, base = self.attempts, self._version, self._drafter
        t0 = time.perf_counter()
        record = UpdateRecord(attempt, version, version, "rolled_back", "", len(rollouts), 0, [], None, None, 0.0)
        try:
            if rollouts:
                self._train_and_publish(rollouts, base, record)
            else:
                record.reason = "empty_buffer"
        except Exception as e:  # a failed update never takes the server down; the old version keeps serving
            record.outcome, record.reason = "rolled_back", f"error: {type(e).__name__}: {e}"
        record.seconds = time.perf_counter() - t0
        with self._lock:
            self.history.append(record)
            self.zero_weight_updates += int(record.reason == "zero_weight")
        return record

    def _window(self, r: Rollout) -> Optional[Tuple[int, int]]:
        """The tokens of ``r`` an update trains on: None (all) within ``train_window``, else a window of that many
        tokens drawn uniformly among those that hold only tokens from the first response prediction on (the last
        ``train_window`` tokens when the response is shorter)."""
        size, n = self.config.train_window, r.num_tokens
        if n <= size:
            return None
        low = max(0, min(len(r.prompt_ids) - 1, n - size))
        start = low + int(torch.randint(n - size - low + 1, (1,), generator=self._rng))
        return start, start + size

    def _kd_batch(
        self,
        rollouts: List[Rollout],
        windows: List[Optional[Tuple[int, int]]],
        batch: Batch,
        base: Eagle3Drafter,
        record: UpdateRecord,
    ) -> Batch:
        """The copy's feature batch with its KD target from the served top-k when every rollout has one."""
        prompt_lens = [len(r.prompt_ids) - (w[0] if w else 0) for r, w in zip(rollouts, windows)]  # in-row index
        record.target_logp_gap = sampled_logp_gap(batch, prompt_lens, [_served_token_logp(r) for r in rollouts])
        if self.kd_target == "copy" or any(r.target_top_logprobs is None for r in rollouts):
            record.target_source = "copy"
            return batch
        record.target_source = "served"
        batch, record.served_masked = served_target(
            batch, prompt_lens, [r.target_top_logprobs for r in rollouts], base.t2d
        )
        return batch

    def _follow_target_head(self, drafter: Eagle3Drafter) -> None:
        """A drafter whose served form holds the target's lm_head tensor (``head_from_target``) takes the policy
        copy's current head: a policy push moved the server's drafter head with the target's, and only the copy
        learned of it (``set_policy``)."""
        model = _bound_model(self.features)
        head = model.get_output_embeddings() if model is not None else None
        if not drafter.cfg.head_from_target or head is None:
            return
        lock = getattr(self.features.__self__, "_lock", None)  # the copy's push lock (``TargetFeatures``)
        with lock or contextlib.nullcontext(), torch.no_grad():
            drafter.lm_head.weight.copy_(head.weight.to(drafter.lm_head.weight.dtype))

    def _train_and_publish(self, rollouts: List[Rollout], base: Eagle3Drafter, record: UpdateRecord) -> None:
        cfg = self.config
        self._follow_target_head(base)  # (under the update lock: the serving drafter, in place)
        # each optimizer step's micro-batch is drawn first: the copy runs only on the rollouts some step trains on
        # (at most train_steps x micro_batch of them, however many were posted), so an update's time and memory are
        # bounded by the config, not by the buffer
        picks = [torch.randperm(len(rollouts), generator=self._rng)[: cfg.micro_batch] for _ in range(cfg.train_steps)]
        mode = "none" if cfg.variant == "unweighted" else self.weight_mode
        weights = reward_weights([r.reward for r in rollouts], mode, cfg.w_max)  # normalised over all drained
        if not any(float(weights[idx].sum()) > 0 for idx in picks):  # every loss would be 0: nothing to publish
            record.reason = "zero_weight"
            return
        used = sorted({int(i) for idx in picks for i in idx})
        row = torch.full((len(rollouts),), -1, dtype=torch.long)
        row[used] = torch.arange(len(used))
        trained = [rollouts[i] for i in used]
        windows = [self._window(r) for r in trained]
        record.tokens = sum(r.num_tokens if w is None else w[1] - w[0] for r, w in zip(trained, windows))
        feats = self.features([(r.prompt_ids, r.response_ids) for r in trained], windows=windows)
        batch = self._kd_batch(trained, windows, feats, base, record)
        probe = self.features(self.probe) if self.probe else None
        if probe is not None:
            record.acceptance_before = acceptance_length(base, probe, cfg.probe_steps)

        cand = copy.deepcopy(base).train()
        params = [p for p in cand.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        for idx in picks:
            loss, _ = reward_weighted_kd(
                cand, batch.select(row[idx].tolist()), [], steps=cfg.kd_steps, weights=weights[idx]
            )
            record.losses.append(float(loss.detach()))
            if not torch.isfinite(loss):
                record.reason = "nan_loss"
                return
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        cand.eval()
        if not all(torch.isfinite(p).all() for p in params):
            record.reason = "nan_weights"
            return
        if probe is not None:
            record.acceptance_after = acceptance_length(cand, probe, cfg.probe_steps)
            before, after = record.acceptance_before - 1.0, record.acceptance_after - 1.0
            if not math.isfinite(after) or after < cfg.collapse_ratio * before:
                record.reason = "acceptance_collapse"
                return
        new_version = record.version_before + 1
        if self.publish is not None:
            try:
                result = self.publish(new_version, cand.hot_swap_tensors())
            except Exception as e:
                record.reason = f"publish_failed: {e}"
                record.replicas = [asdict(r) for r in getattr(e, "results", ())] or None
                if getattr(e, "restored", False):  # the publisher already handled each replica
                    return
                try:  # the server may hold part of the push: put the serving version back
                    self.publish(record.version_before, base.hot_swap_tensors())
                except Exception as e2:
                    record.reason += f"; restore failed: {e2}"
                return
            if isinstance(result, dict) and result.get("replicas") is not None:
                record.replicas = result["replicas"]
                if result.get("failed"):  # published; these replicas keep their old drafter
                    record.reason = "replicas_failed: " + ", ".join(result["failed"])
        with self._lock:
            self._drafter, self._version = cand, new_version
        record.outcome, record.version_after = "published", new_version


def _bound_model(fn: Any) -> Optional[torch.nn.Module]:
    """The ``model`` of the object ``fn`` is bound to (the policy copy, ``TargetFeatures``), None if there is none."""
    model = getattr(getattr(fn, "__self__", None), "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def _resolve(future: Future, result: Any = None, error: Optional[BaseException] = None) -> None:
    """Complete ``future`` with ``result`` or ``error``; a Future its waiter cancelled is left as it is."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _served_token_logp(r: Rollout) -> Optional[List[Optional[float]]]:
    """The served log p of each sampled response token: ``target_logprobs``, else its top-k entry (None if absent)."""
    if r.target_logprobs is not None:
        return r.target_logprobs.tolist()
    if r.target_top_logprobs is None:
        return None
    return r.target_top_logprobs.logp_of(r.response_ids)

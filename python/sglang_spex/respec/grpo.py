"""A small GRPO loop against a running SGLang server: the rollout side of ReSpec's online learner
(run setup — warm start, bootstrap drafter, server args — is in ``grpo_setup``).

Per policy step: sample G completions for each of P prompts from the server (``/generate``, token ids in and
out), score them with the task's verifier, normalise rewards within each group (the advantage), take a policy
step on the client's HF copy (:class:`~sglang_spex.respec.policy.Policy`), push the new weights into the server
through SGLang's own weight-update session (``/update_weights_from_tensor``, ``selector="target"``; the
in-memory path works on CPU and needs no shared filesystem), and post the rollouts to the learner
(``POST /respec/rollouts``; with ``sync_learner_policy`` also ``POST /respec/policy`` so KD follows the policy).
When the rollouts go to a learner and ``top_logprobs_num`` > 0, the rollout requests also ask SGLang for
``return_logprob`` and the top-``top_logprobs_num`` log-probs per output token, and each posted rollout carries
them (``target_logprobs``, ``target_top_logprobs``): the learner's KD target then comes from the served model.
While the learner answers ``training: false`` (idle, or its payback gate skips updates), the loop sends neither
the log-probs nor the policy copy, which only an update would use; the rollouts are still posted, in the
background (no update can run inside that post), and the answer is read at the start of the next step.

Each step also reports what speculation did for its rollouts (SGLang's ``meta_info``: tokens per verify pass =
acceptance length) and rollout throughput, which is what ``benchmark/bench_respec_learner.py`` plots.
"""

from __future__ import annotations

import math
import random
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import httpx
import torch

from sglang_spex.respec import policy_wire, rollout_wire
from sglang_spex.respec.buffer import served_fields
from sglang_spex.respec.hotswap import HotSwapClient
from sglang_spex.respec.policy import Policy
from sglang_spex.tot.tasks import Question, TaskSet

POLICY_VERSION_PREFIX = "policy-"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> List[float]:
    """GRPO advantages: (r − mean(group)) / std(group) within consecutive groups of ``group_size``; a group
    whose rewards are all equal (std ≤ eps) gets 0 for every member (it carries no signal)."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.as_tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    adv = torch.where(std > eps, (r - mean) / std.clamp(min=eps), torch.zeros_like(r))
    return adv.flatten().tolist()


def extract_number(text: str) -> Optional[str]:
    """The stated answer: the first number after "answer is", else the last number in the text."""
    if "answer is" in text:
        m = _NUMBER.search(text.split("answer is", 1)[1])
        return m.group(0) if m else None
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def verifier_reward(task: TaskSet) -> Callable[[str, Question], float]:
    """1.0 when the task's own checker accepts the extracted answer, else 0.0."""

    def reward(text: str, q: Question) -> float:
        return 1.0 if task.check_answer(extract_number(text), q) else 0.0

    return reward


@dataclass
class GRPOConfig:
    prompts_per_step: int = 4
    group_size: int = 4  # G
    max_new_tokens: int = 32
    temperature: float = 1.0
    inner_steps: int = 2  # optimizer steps per policy step
    seed: int = 0
    split: str = "dev"
    sync_learner_policy: bool = True
    # each rollout request carries a sampling_seed from (seed, step, index); SGLang 0.5.23 samples by it only under
    # --enable-deterministic-inference or --tot-speculation (hook H2): on a plain or ReSpec server rollouts stay
    # unseeded (checked: one seed, three different samples), so runs pair by RL seed, not by sample
    seed_rollouts: bool = True
    # served top-k log-probs per token posted with the rollouts when they go to a learner (0: none, KD uses the
    # copy); a ReSpec server's off steps stay plain decode steps for such batches (spec_workers.keeps_spec_path)
    top_logprobs_num: int = 20

    def validate(self) -> "GRPOConfig":
        if min(self.prompts_per_step, self.group_size, self.max_new_tokens, self.inner_steps) < 1:
            raise ValueError("prompts_per_step, group_size, max_new_tokens and inner_steps must be >= 1")
        if self.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (GRPO needs distinct samples in a group)")
        return self


@dataclass
class Sample:
    question: Question
    prompt_ids: List[int]
    response_ids: List[int]
    text: str
    reward: float = 0.0
    meta: dict = field(default_factory=dict)


@dataclass
class StepStats:
    step: int
    policy_version: int
    reward_mean: float
    accuracy: float
    loss: float
    clip_frac: float
    rollout_tokens: int
    rollout_seconds: float
    tokens_per_s: float
    accept_length: Optional[float]  # completion tokens / verify passes (None without speculation)
    weight_version: str
    learner: Optional[dict] = None  # the learner's answer to the rollouts posted last (a step late when in background)
    seconds: float = 0.0
    # where the step's wall-clock goes (seconds): rollouts, the policy's optimizer steps, the policy push into
    # the server(s), and the learner calls (rollouts + policy copy; a sync learner trains inside them; a background
    # rollout post counts the time the next step waited for it)
    generation_s: float = 0.0
    policy_update_s: float = 0.0
    push_s: float = 0.0
    drafter_update_s: float = 0.0
    active_batch: float = 0.0  # time-averaged number of unfinished rollout requests during generation
    approx_kl: float = 0.0  # policy step size (see policy.Policy.grpo_step)


def accept_length(metas: Sequence[dict]) -> Optional[float]:
    """Tokens per verify pass over a set of SGLang ``meta_info`` dicts (None when no verify pass ran)."""
    verify = sum(m.get("spec_verify_ct") or 0 for m in metas)
    return sum(m["completion_tokens"] for m in metas) / verify if verify else None


def chat_prompt_ids(tokenizer, text: str) -> List[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def rollout_payloads(samples: Sequence[Sample]) -> List[dict]:
    """The ``POST /respec/rollouts`` entries of ``samples``, with the served log-probs their ``meta`` holds."""
    return [
        {
            "prompt_ids": s.prompt_ids,
            "response_ids": s.response_ids,
            "reward": s.reward,
            **served_fields(s.meta, len(s.response_ids)),
        }
        for s in samples
    ]


DEFAULT_POST_LIMIT = 1 << 20  # a learner that does not report its limit


class ServerClient:
    """The few SGLang HTTP calls the loop makes (``/generate``, ``/model_info``, the learner routes)."""

    def __init__(self, url: str, learner_url: Optional[str] = None, timeout: float = 900.0):
        self.url = url.rstrip("/")
        self.learner_url = (learner_url or url).rstrip("/")
        self.timeout = timeout
        self.last_active_batch = 0.0
        self._post_limit: Optional[int] = None  # the learner's max_post_bytes, read at the first post

    def generate(
        self, input_ids: List[List[int]], params, concurrency: int = 0, extra: Optional[dict] = None
    ) -> List[dict]:
        """One request per sequence when ``concurrency`` > 0 (finish independently, like RL rollouts); then
        ``last_active_batch`` is the time-averaged number of requests still running. ``params``: one sampling-params
        dict for all, or a list with one per sequence; ``extra``: more ``/generate`` fields (e.g. ``return_logprob``).
        """
        extra = extra or {}
        if concurrency <= 0:
            return self._post(self.url + "/generate", {"input_ids": input_ids, "sampling_params": params, **extra})
        per = params if isinstance(params, list) else [params] * len(input_ids)
        bodies = [{"input_ids": ids, "sampling_params": p, **extra} for ids, p in zip(input_ids, per)]
        t0 = time.perf_counter()

        def one(body: dict):
            out = self._post(self.url + "/generate", body)
            return out, time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=concurrency) as ex:
            done = list(ex.map(one, bodies))
        wall = max(dt for _, dt in done)
        self.last_active_batch = sum(dt for _, dt in done) / wall if wall > 0 else float(len(done))
        return [out for out, _ in done]

    def weight_version(self) -> str:
        return httpx.get(self.url + "/model_info", timeout=60).json()["weight_version"]

    def post_rollouts(self, rollouts: List[dict]) -> dict:
        """One RL step's rollouts, in as many posts as the learner's body limit (``max_post_bytes`` in its state)
        needs, as binary bodies (``rollout_wire.py``): each but the last with ``more``. Returns the last post's answer,
        ``accepted`` summed."""
        if self._post_limit is None:
            self._post_limit = int(self.learner_state().get("max_post_bytes") or DEFAULT_POST_LIMIT)
        url, accepted, answer = self.learner_url + "/respec/rollouts", 0, {}
        for part in rollout_wire.parts(rollouts, self._post_limit):  # binary bodies: milliseconds to decode
            answer = self._post(url, content=part)
            accepted += answer.get("accepted", 0)
        return {**answer, "accepted": accepted}

    def post_policy(self, version: int, named) -> dict:
        """The policy's weights to the learner's copy, as one binary body (``policy_wire.py``)."""
        return self._post(self.learner_url + "/respec/policy", content=policy_wire.encode(version, named))

    def learner_state(self) -> dict:
        return httpx.get(self.learner_url + "/respec/state", timeout=60).json()

    def _post(self, url: str, body: Optional[dict] = None, content: Optional[bytes] = None):
        headers = {"content-type": rollout_wire.CONTENT_TYPE} if content is not None else None
        r = httpx.post(url, json=body, content=content, headers=headers, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"POST {url}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()


class GRPOLoop:
    """Sample → score → advantages → policy step → push → post rollouts, one :meth:`step` at a time. The policy's
    temperature must equal ``config.temperature`` (the sampler's; ValueError otherwise): GRPO's π is the sampling
    distribution."""

    def __init__(
        self,
        client: ServerClient,
        policy: Policy,
        tokenizer,
        task: TaskSet,
        config: Optional[GRPOConfig] = None,
        reward_fn: Optional[Callable[[str, Question], float]] = None,
        post_rollouts: bool = True,
        mirrors: Sequence[ServerClient] = (),
    ):
        self.config = (config or GRPOConfig()).validate()
        temperature = getattr(policy, "temperature", None)  # (None: a sampling-only loop without a policy)
        if temperature is not None and not math.isclose(temperature, self.config.temperature, rel_tol=1e-9):
            raise ValueError(
                f"Policy.temperature {temperature} != GRPOConfig.temperature {self.config.temperature}: the "
                "policy's log-probs would not be those of the sampler (an off-policy GRPO objective)"
            )
        self.client = client
        self.servers = [client, *mirrors]  # every one gets each policy push and each rollout batch
        self.policy = policy
        self.tokenizer = tokenizer
        self.task = task
        self.reward_fn = reward_fn or verifier_reward(task)
        self.post = post_rollouts
        self.swaps = [
            HotSwapClient(
                c.url,
                selector="target",
                flush_cache=True,
                pause_in_place=False,
                version_prefix=POLICY_VERSION_PREFIX,
                begin_retries=240,
            )
            for c in self.servers
        ]
        self.last_questions: List[Question] = []
        self.last_distinct = 0.0
        self._rng = random.Random(self.config.seed)
        self._pool = task.questions(256, split=self.config.split, seed=self.config.seed)
        self.step_index = 0
        self.learner_training = True  # the learner's last "training" answer: False skips log-probs and policy copies
        self._poster: Optional[ThreadPoolExecutor] = None  # background rollout posts while the learner is not training
        self._pending_post: Optional[Future] = None

    def sample(
        self, questions: Sequence[Question], client: Optional[ServerClient] = None, logprobs: bool = False
    ) -> List[Sample]:
        """G completions per question from the server (default: the rollout one) at the policy's temperature; with
        ``logprobs`` each ``meta`` also holds the served log-probs (``config.top_logprobs_num`` per token)."""
        cfg = self.config
        prompts = [chat_prompt_ids(self.tokenizer, q.text) for q in questions]
        ids = [p for p in prompts for _ in range(cfg.group_size)]
        params = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}
        if cfg.seed_rollouts:
            base = (cfg.seed * 100_003 + self.step_index) * 1_000
            params = [{**params, "sampling_seed": base + i} for i in range(len(ids))]
        extra = {"return_logprob": True, "top_logprobs_num": cfg.top_logprobs_num} if logprobs else None
        outs = (client or self.client).generate(ids, params, concurrency=len(ids), extra=extra)
        samples = []
        for i, out in enumerate(outs):
            q = questions[i // cfg.group_size]
            resp = list(out["output_ids"]) or [self.tokenizer.eos_token_id]
            text = self.tokenizer.decode(resp, skip_special_tokens=True)
            samples.append(Sample(q, ids[i], resp, text, self.reward_fn(text, q), out["meta_info"]))
        groups = [samples[g : g + cfg.group_size] for g in range(0, len(samples), cfg.group_size)]
        # distinct responses per group: 1 everywhere would mean argmax, not sampling (e.g. a greedy verify)
        self.last_distinct = sum(len({tuple(s.response_ids) for s in grp}) for grp in groups) / len(groups)
        return samples

    def evaluate(
        self, questions: Sequence[Question], client: Optional[ServerClient] = None
    ) -> Dict[str, Optional[float]]:
        """Sample groups for ``questions`` without training or posting: reward, acceptance length, tokens/s."""
        t0 = time.perf_counter()
        samples = self.sample(questions, client)
        dt = time.perf_counter() - t0
        tokens = sum(len(s.response_ids) for s in samples)
        return {
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "accept_length": accept_length([s.meta for s in samples]),
            "tokens": tokens,
            "tokens_per_s": tokens / dt if dt > 0 else 0.0,
        }

    def push(self) -> float:
        """Policy weights → every serving engine; returns the seconds the learner calls took (each learner's
        policy copy, when configured)."""
        named = self.policy.named_tensors()
        learner_s = 0.0
        for client, swap in zip(self.servers, self.swaps):
            swap.push(self.policy.version, named)
            if self.post and self.config.sync_learner_policy and self.learner_training:
                t = time.perf_counter()
                client.post_policy(self.policy.version, named)
                learner_s += time.perf_counter() - t
        return learner_s

    def collect_post(self) -> Optional[dict]:
        """Wait for a rollout post still in flight and read its answer (raises its error); None if there is none."""
        if self._pending_post is None:
            return None
        pending, self._pending_post = self._pending_post, None
        answer = pending.result()
        self.learner_training = bool(answer.get("training", True))
        return answer

    def _post_rollouts(self, samples: Sequence[Sample]) -> Optional[dict]:
        rollouts = rollout_payloads(samples)

        def post() -> dict:
            return [c.post_rollouts(rollouts) for c in self.servers][0]

        if not self.learner_training:  # nothing trains inside this post: do not wait for it
            self._poster = self._poster or ThreadPoolExecutor(1, thread_name_prefix="grpo-post")
            self._pending_post = self._poster.submit(post)
            return None
        answer = post()
        self.learner_training = bool(answer.get("training", True))
        return answer

    def step(self) -> StepStats:
        cfg = self.config
        t0 = time.perf_counter()
        earlier = self.collect_post()
        t_wait = time.perf_counter() - t0
        questions = self.last_questions = self._rng.sample(self._pool, cfg.prompts_per_step)
        samples = self.sample(questions, logprobs=self.post and cfg.top_logprobs_num > 0 and self.learner_training)
        t_roll = time.perf_counter() - t0 - t_wait
        rewards = [s.reward for s in samples]
        adv = group_advantages(rewards, cfg.group_size)
        upd = self.policy.grpo_step([(s.prompt_ids, s.response_ids) for s in samples], adv, cfg.inner_steps)
        t_policy = time.perf_counter() - t0 - t_wait - t_roll
        learner_s = self.push()
        t_push = time.perf_counter() - t0 - t_wait - t_roll - t_policy - learner_s
        learner_s += t_wait
        learner = earlier
        if self.post:
            t = time.perf_counter()
            learner = self._post_rollouts(samples) or earlier
            learner_s += time.perf_counter() - t
        tokens = sum(len(s.response_ids) for s in samples)
        stats = StepStats(
            step=self.step_index,
            policy_version=self.policy.version,
            reward_mean=sum(rewards) / len(rewards),
            accuracy=sum(r >= 1.0 for r in rewards) / len(rewards),
            loss=upd["loss"],
            clip_frac=upd["clip_frac"],
            rollout_tokens=tokens,
            rollout_seconds=t_roll,
            tokens_per_s=tokens / t_roll if t_roll > 0 else 0.0,
            accept_length=accept_length([s.meta for s in samples]),
            weight_version=self.client.weight_version(),
            learner=learner,
            seconds=time.perf_counter() - t0,
            generation_s=t_roll,
            policy_update_s=t_policy,
            push_s=t_push,
            drafter_update_s=learner_s,
            active_batch=self.client.last_active_batch,
            approx_kl=upd.get("approx_kl", 0.0),
        )
        self.step_index += 1
        return stats

    def run(self, steps: int, progress: bool = True) -> Iterator[StepStats]:
        """``steps`` policy steps, yielding each step's stats (with a tqdm bar when ``progress``)."""
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="grpo", disable=not progress)
        try:
            for _ in range(steps):
                s = self.step()
                acc = f"{s.accept_length:.2f}" if s.accept_length else "-"
                bar.set_postfix(reward=f"{s.reward_mean:.2f}", accept=acc, tok_s=f"{s.tokens_per_s:.0f}")
                bar.update(1)
                yield s
            self.collect_post()  # the last rollouts are with the learner before the caller reads its state
        finally:
            bar.close()


def stats_dict(stats: StepStats) -> Dict:
    return asdict(stats)

"""What one search may ask of a server: capacity limits checked before anything is allocated.

:class:`SearchLimits` bounds a :class:`~sglang_spex.tot.search_spec.SearchSpec` by what the server can hold:
width/branching, depth, iterations/rollouts, a worst-case node count and generated-token count, the step's
``max_tokens`` and the prompt's length against the model's context, and which hosts a reward may call. A spec
over any limit raises :class:`~sglang_spex.tot.validation.SearchSpecError` naming the field and the limit (the
server answers HTTP 400). The server builds its limits from the launcher flags and the live engine
(``srt/search_service.py``); the client-side runner (``tot/search.py``) checks the same defaults.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple
from urllib.parse import urlsplit

from sglang_spex.tot.validation import check

LOOPBACK = "loopback"  # allowlist entry: localhost and every loopback address (127.0.0.0/8, ::1)
DEFAULT_REWARD_HOSTS: Tuple[str, ...] = (LOOPBACK,)
MAX_HOST_CHARS = 253  # DNS: the longest host name
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")  # one label of a host name (underscores: container names)


@dataclass(frozen=True)
class SearchLimits:
    """Per-search limits; ``flag`` names the launcher flag each one comes from (shown in error reasons)."""

    max_width: int = 256  # BFS width / MCTS branching (children per expansion)
    max_depth: int = 64
    max_iterations: int = 1024  # MCTS rollouts / iterations, and target answers
    max_nodes: int = 4096  # worst case the spec can generate (steps and partial rollouts)
    max_search_tokens: int = 2**21  # worst-case generated tokens of one search
    max_step_tokens: int = 8192  # a step's max_tokens (<= the model's context)
    context_len: Optional[int] = None  # the model's context; prompt + one step must fit (None: not checked)
    max_input_len: Optional[int] = None  # the engine's longest prompt (SGLang's max_req_input_len)
    reward_hosts: Tuple[str, ...] = DEFAULT_REWARD_HOSTS

    FLAGS = {
        "max_width": "--tot-max-width",
        "max_depth": "--tot-max-depth",
        "max_iterations": "--tot-max-iterations",
        "max_nodes": "--tot-max-nodes",
        "max_search_tokens": "--tot-max-search-tokens",
        "max_step_tokens": "--tot-max-step-tokens",
        "reward_hosts": "--tot-reward-hosts",
    }

    def to_dict(self) -> Dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    WHERE = "this server's"  # whose limits these are, in error reasons

    def source(self, limit_name: str) -> str:
        """What sets the limit ``limit_name`` (shown in error reasons): the server's launcher flag."""
        return self.FLAGS.get(limit_name, limit_name)

    def _within(self, value: Any, limit_name: str, field_name: str, what: str = "") -> None:
        limit = getattr(self, limit_name)
        check(
            value <= limit, field_name, f"{what}{value} is over {self.WHERE} limit {limit} ({self.source(limit_name)})"
        )

    def check_spec(self, spec: Any, prompt_tokens: Optional[int] = None) -> None:
        """Raise ``SearchSpecError`` naming the first field of ``spec`` (validated) that is over a limit;
        ``prompt_tokens``: the tokenized length of the search's prompt (prompt template + question)."""
        params = spec.policy.build().params
        for name in ("width", "branch", "roll_branch"):
            if hasattr(params, name):
                self._within(getattr(params, name), "max_width", f"policy.{name}")
        self._within(params.max_depth, "max_depth", "policy.max_depth")
        for name in ("num_rollouts", "iterations", "target_answers"):
            if getattr(params, name, None) is not None:
                self._within(getattr(params, name), "max_iterations", f"policy.{name}")
        nodes = node_bound(params)
        self._within(nodes, "max_nodes", "policy", "the number of nodes this policy can generate, ")
        self._within(spec.step.max_tokens, "max_step_tokens", "step.max_tokens")
        self._within(
            nodes * spec.step.max_tokens, "max_search_tokens", "step.max_tokens", f"{nodes} nodes × max_tokens = "
        )
        if prompt_tokens is not None and not self.fits(prompt_tokens, spec.step.max_tokens):
            check(
                False,
                "question",
                f"the prompt is {prompt_tokens} tokens; with step.max_tokens {spec.step.max_tokens} it does not fit "
                f"the model (context length {self.context_len}, longest prompt {self.max_input_len} tokens)",
            )
        if spec.reward.url is not None:
            self.check_reward_url(spec.reward.url)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """A request of ``prompt_tokens`` generating up to ``max_tokens`` fits the engine (SGLang's own checks)."""
        if self.max_input_len is not None and prompt_tokens > self.max_input_len:
            return False
        return self.context_len is None or prompt_tokens + max_tokens <= self.context_len

    def check_reward_url(self, url: str, field_name: str = "reward.url") -> None:
        """The URL's host is on the allowlist (``reward_hosts``); no connection is made to find out."""
        try:
            host = urlsplit(url).hostname
        except ValueError:
            host = None
        check(bool(host), field_name, "must be an http(s) URL with a host")
        check(
            host_allowed(host, self.reward_hosts),
            field_name,
            f"host {host!r} is not allowed by {self.WHERE} reward hosts (allowed: {list(self.reward_hosts)}; "
            f"{self.source('reward_hosts')})",
        )


def node_bound(params: Any) -> int:
    """The most nodes a policy with these params can generate (BFS: width per depth; rSTAR: ``branch``
    children per expansion, ``max_depth`` expansions per rollout; REST: one expansion and its partial rollout
    per iteration)."""
    depth = params.max_depth
    if hasattr(params, "width"):
        return params.width * depth
    if hasattr(params, "num_rollouts"):
        return params.num_rollouts * depth * params.branch
    if hasattr(params, "iterations"):
        return params.iterations * (params.branch + params.roll_forward_steps * params.roll_branch)
    raise TypeError(f"no node bound for {type(params).__name__}")


def valid_host_entry(entry: Any) -> bool:
    """``entry`` is something :func:`host_allowed` can match: ``*``, ``loopback``, an IP, a CIDR network, or a
    host name (labels of letters, digits, ``-`` and ``_``; the last not all digits, as in a mistyped IP)."""
    if not isinstance(entry, str):
        return False
    entry = entry.strip().lower()
    if entry in ("*", LOOPBACK):
        return True
    try:
        ipaddress.ip_network(entry, strict=False)
        return True
    except ValueError:
        pass
    labels = entry.removesuffix(".").split(".")
    return len(entry) <= MAX_HOST_CHARS and all(map(_HOST_LABEL.fullmatch, labels)) and not labels[-1].isdigit()


def parse_reward_hosts(text: str) -> Tuple[str, ...]:
    """The allowlist in a comma list (``--tot-reward-hosts``); ValueError naming an entry that is not one."""
    hosts = tuple(h.strip() for h in text.split(",") if h.strip()) or ("",)
    bad = [h for h in hosts if not valid_host_entry(h)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a host name, IP, CIDR network, loopback or * (in {text!r})")
    return hosts


def host_allowed(host: str, allowed: Tuple[str, ...]) -> bool:
    """``host`` matches an entry: ``*`` (any), ``loopback``, an exact name, an IP, or a CIDR network."""
    host = host.lower().rstrip(".")
    ip = _ip_or_none(host)
    for entry in allowed:
        entry = entry.strip().lower()
        if entry == "*":
            return True
        if entry == LOOPBACK:
            if host == "localhost" or (ip is not None and ip.is_loopback):
                return True
            continue
        if "/" in entry:
            try:
                if ip is not None and ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if host == entry.rstrip(".") or (ip is not None and ip == _ip_or_none(entry)):
            return True
    return False


def _ip_or_none(text: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def derive(
    configured: Dict[str, Optional[int]],
    *,
    context_len: Optional[int],
    max_running_requests: Optional[int],
    kv_tokens: Optional[int],
    max_input_len: Optional[int] = None,
    reward_hosts: Tuple[str, ...] = DEFAULT_REWARD_HOSTS,
) -> SearchLimits:
    """Limits from the flags (``configured``: field → value, None = auto) and the live server: width defaults to
    the engine's running-request slots, a step's tokens to the context length, a search's tokens to 16 KV pools."""
    base = SearchLimits()
    auto = {
        "max_width": max_running_requests or base.max_width,
        "max_step_tokens": context_len or base.max_step_tokens,
        "max_search_tokens": 16 * kv_tokens if kv_tokens else base.max_search_tokens,
    }
    values = {}
    for f in dataclasses.fields(SearchLimits):
        if f.name in ("context_len", "max_input_len", "reward_hosts"):
            continue
        given = configured.get(f.name)
        values[f.name] = given if given is not None else auto.get(f.name, getattr(base, f.name))
    if context_len:
        values["max_step_tokens"] = min(values["max_step_tokens"], context_len)
    return SearchLimits(
        **values, context_len=context_len, max_input_len=max_input_len, reward_hosts=tuple(reward_hosts)
    )

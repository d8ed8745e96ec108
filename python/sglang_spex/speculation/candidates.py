"""A speculative candidate (the node to generate ahead of the search), the order refills issue them in, and what a
search knows of the radix cache's prefixes (which candidates' prompts are cached)."""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

from sglang_spex.tot.tree import DONE, KIND_STEP, Node, child_path

CHARS_PER_TOKEN = 4  # prompt-length estimate where SGLang has not reported a token count yet


class Candidate(NamedTuple):
    """A node to generate speculatively: the ``index``-th child (or rollout sample) of ``parent``."""

    parent: Node
    index: int
    distance: int  # prediction distance (DFS: rollouts ahead; BFS and partial rollouts: steps ahead)
    kind: str = KIND_STEP
    use: Optional[float] = None  # its expected use when known at planning time (partial rollouts)

    @property
    def path(self) -> str:
        return child_path(self.parent.path, self.index, self.kind)


def refill_key(expected_use: float, distance: int, cached_tokens: int, recency: int) -> Tuple[float, int, int, int]:
    """Sort key of a speculative candidate (ascending = issued first): expected use, then the nearer (needed
    sooner), then the prefix tokens the radix cache holds for it, then how recently its parent finished."""
    return (-round(expected_use, 9), int(distance), -int(cached_tokens), -int(recency))


class CachedPrefixes:
    """The order a search's node sequences finished (reached the radix cache; its recency) and the question
    prompt's tokens: what the prefix-aware refill and T2's S_KV read."""

    def __init__(self) -> None:
        self.order: Dict[str, int] = {}  # node path -> finish sequence number
        self.root_prompt_tokens = 0  # tokens of the question prompt (reported with any depth-1 node)

    def finished(self, node: Node, root_path: str) -> None:
        """``node``'s sequence reached the radix cache (a request that finished normally)."""
        if node.status != DONE or node.path in self.order:  # an adopted node reached the cache earlier
            return
        self.order[node.path] = len(self.order) + 1
        if node.depth == 1 and node.prompt_tokens:
            self.root_prompt_tokens = node.prompt_tokens
            self.order.setdefault(root_path, self.order[node.path])

    def recency(self, path: str) -> int:
        return self.order.get(path, 0)

    def child_prefix(self, parent: Node, prompt_for: Callable[[Node], str]) -> Tuple[int, int]:
        """(prompt tokens of a child of ``parent``, of them the tokens the radix cache holds), as far as the search
        knows: a finished parent's prompt + step tokens (SGLang's counts) are cached; an unreported length is
        estimated from the characters of ``prompt_for(parent)`` and counted as not cached."""
        if parent.is_root:
            if self.root_prompt_tokens:
                return self.root_prompt_tokens, self.root_prompt_tokens
        elif parent.status == DONE and parent.prompt_tokens and parent.path in self.order:
            total = parent.prompt_tokens + parent.num_tokens
            return total, total
        return len(prompt_for(parent)) // CHARS_PER_TOKEN, 0

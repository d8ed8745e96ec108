"""The search tree: nodes identified by deterministic paths, each with its own sampling seed.

Paths are dot-separated child indices from the root ``"r"`` (``"r.0.2"``); a child's index is its
creation order under its parent, so the same search creates the same paths. Partial-rollout nodes
(REST-MCTS simulation) hang off ``Node.rollouts`` with paths ``"<parent>.g<i>"`` and never count as
tree children. ``node_seed(search_seed, path)`` is a pure function: a node generated twice (e.g. by
speculation and later by the policy itself) gets the same seed and hence the same sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from sglang_spex.tot.answer_key import normalize

ROOT_PATH = "r"

PENDING = "pending"
GENERATING = "generating"
DONE = "done"
CANCELLED = "cancelled"
FAILED = "failed"
STATUSES = (PENDING, GENERATING, DONE, CANCELLED, FAILED)

KIND_STEP = "step"
KIND_ROLLOUT = "rollout"


def node_seed(search_seed: int, path: str) -> int:
    """Sampling seed of the node at ``path``: a pure function of (search seed, path), in [0, 2**31)."""
    digest = hashlib.sha256(f"{int(search_seed)}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**31 - 1)


def child_path(parent_path: str, index: int, kind: str = KIND_STEP) -> str:
    return f"{parent_path}.{index}" if kind == KIND_STEP else f"{parent_path}.g{index}"


@dataclass(eq=False)
class Node:
    """One reasoning step (the root holds no text)."""

    path: str
    parent: Optional["Node"] = None
    kind: str = KIND_STEP
    seed: int = 0
    rid: str = ""
    text: str = ""
    children: List["Node"] = field(default_factory=list)
    rollouts: List["Node"] = field(default_factory=list)
    status: str = PENDING
    num_tokens: int = 0  # tokens generated for this step
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: List[float] = field(default_factory=list)
    finish_reason: str = ""
    reward: Optional[float] = None
    visits: int = 0  # MCTS N
    value: float = 0.0  # MCTS Q (rSTAR: sum of rewards) or V (REST)
    is_terminal: bool = False
    answer: Optional[str] = None
    error: Optional[str] = None
    latency: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def cum_tokens(self) -> int:
        """Tokens generated along the path from the root to this node (inclusive)."""
        return self.num_tokens + (self.parent.cum_tokens if self.parent is not None else 0)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def ok(self) -> bool:
        return self.status == DONE

    def ancestors(self) -> List["Node"]:
        """Root-first list of the nodes above this one (root included)."""
        out, n = [], self.parent
        while n is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def trajectory(self) -> List["Node"]:
        """Root-exclusive, root-first list of steps ending with this node."""
        return [n for n in self.ancestors() if not n.is_root] + ([] if self.is_root else [self])

    def trajectory_text(self) -> str:
        return "".join(n.text for n in self.trajectory())

    def step_rewards(self) -> List[float]:
        return [n.reward for n in self.trajectory() if n.reward is not None]

    def live_children(self) -> List["Node"]:
        return [c for c in self.children if c.status == DONE]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "parent": self.parent.path if self.parent is not None else None,
            "kind": self.kind,
            "depth": self.depth,
            "text": self.text,
            "status": self.status,
            "reward": self.reward,
            "visits": self.visits,
            "value": self.value,
            "terminal": self.is_terminal,
            "answer": self.answer,
            "vote_key": normalize(self.answer) if self.answer is not None else None,  # answers with one key: one vote
            "tokens": self.num_tokens,
            "cum_tokens": self.cum_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,  # of the prompt, served from SGLang's radix cache
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "rid": self.rid,
            "error": self.error,
            "speculative": bool(self.extra.get("speculative")),  # SPEX generated it ahead; the search adopted it
        }


class Tree:
    """All nodes of one search, by path."""

    def __init__(self, search_seed: int = 0):
        self.search_seed = int(search_seed)
        self.root = Node(path=ROOT_PATH, seed=node_seed(search_seed, ROOT_PATH), status=DONE)
        self.nodes: Dict[str, Node] = {ROOT_PATH: self.root}

    def get(self, path: str) -> Node:
        return self.nodes[path]

    def child(self, parent: Node, index: int, kind: str = KIND_STEP) -> Node:
        """The ``index``-th child (or rollout) of ``parent``, created (pending) if it does not exist yet.

        Children are created in index order; asking for index ``len(children)`` appends one.
        """
        siblings = parent.children if kind == KIND_STEP else parent.rollouts
        if index < len(siblings):
            return siblings[index]
        if index != len(siblings):
            raise IndexError(f"child {index} of {parent.path} requested before child {len(siblings)}")
        path = child_path(parent.path, index, kind)
        node = Node(path=path, parent=parent, kind=kind, seed=node_seed(self.search_seed, path))
        siblings.append(node)
        self.nodes[path] = node
        return node

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def at_depth(self, depth: int, kind: str = KIND_STEP) -> List[Node]:
        return [n for n in self.nodes.values() if n.depth == depth and n.kind == kind and not n.is_root]

    def terminals(self) -> List[Node]:
        """Finished step nodes that carry an answer, in creation order."""
        return [n for n in self.nodes.values() if n.ok and n.kind == KIND_STEP and n.answer is not None]

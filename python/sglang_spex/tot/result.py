"""A finished search's result: the same format client-side (``run_search``) and server-side (``/tot/search``).

``SearchContext.result`` builds it; :func:`judge` checks its answer against a reference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from sglang_spex.tot.answers import check_answer
from sglang_spex.tot.tasks import Question, get_task


@dataclass
class SearchResult:
    search_id: str
    question: str
    policy: str
    status: str  # done | cancelled | failed
    answer: Optional[str]
    correct: Optional[bool]
    reference: Optional[str]
    answers: List[Dict[str, Any]]
    nodes: List[Dict[str, Any]]
    tokens_generated: int
    num_requests: int
    wall_time: float
    failures: List[Dict[str, str]] = field(default_factory=list)
    stop_reason: Optional[str] = None
    error: Optional[str] = None
    speculation: Optional[Dict[str, Any]] = None  # SPEX accounting (None for a baseline search)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SearchResult":
        return cls(**d)


def judge(answer: Optional[str], reference: Optional[str], task: Optional[str]) -> Optional[bool]:
    """Whether ``answer`` matches ``reference`` (by ``task``'s checker, else math-verify); None without one."""
    if reference is None:
        return None
    if task is not None:
        return get_task(task).check_answer(answer, Question("", "", str(reference)))
    return check_answer(answer, str(reference))

"""SGLang scheduler internals used by the SPEX scheduler hooks (SGLang 0.5.23): requests, queues, batches.

Everything that reads or changes a ``Scheduler``, ``ScheduleBatch`` or ``Req`` attribute lives here, so a
version bump touches this file. Where SGLang has a method for a step (aborting, re-queueing, releasing a
running request's KV, the requests its in-flight batch finishes by length) it is called instead of
re-implemented.

Overlap scheduling (``Scheduler.event_loop_overlap``): when ``get_next_batch_to_run`` runs, the batch launched
last step (``last_batch``) is still in ``result_queue``; its results are processed after the next batch is
launched. SGLang's own result processing skips a request that is finished or retracted by then
(``process_batch_result_decode`` / ``_prefill``), and ``release_kv_cache`` frees any KV slot allocated for a
forward whose output is dropped; that is what lets a request of the in-flight batch be finished or
retracted at the scheduling point, exactly as SGLang's priority preemption (``PrefillAdder.preempt_to_schedule``)
does.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from sglang.srt.managers.io_struct import AbortReq
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS
from sglang.srt.mem_cache.common import release_kv_cache

from sglang_spex.tot.engine import ROLE_PRIMARY, ROLE_SPEC, parse_rid

STATE_ATTR = "spex_state"  # the plugin's per-scheduler state, on the Scheduler and on its tree cache
_CLASS_ATTR = "_spex_class"  # (role, search id, node path) cached on a Req
_SPEC_ATTR = "_spex_is_spec"  # its role == ROLE_SPEC, cached beside it (read per request per step)

ReqClass = Tuple[str, Optional[str], str]


# ---------------------------------------------------------------- plugin state and hook arguments
def attach_state(scheduler: Any, state: Any) -> None:
    """Keep ``state`` on the scheduler and on its radix cache (hooks on the cache get it from there)."""
    setattr(scheduler, STATE_ATTR, state)
    setattr(scheduler.tree_cache, STATE_ATTR, state)


def attached_state(obj: Any) -> Optional[Any]:
    """The plugin state attached to a scheduler or its radix cache, or None if none was created yet."""
    return getattr(obj, STATE_ATTR, None)


def charge_hook_time(obj: Any, t0: float, key: str, exclude: float = 0.0) -> None:
    """Add ``perf_counter() - t0 - exclude`` seconds to the hook time (``hook_s``, and ``hook_by[key]``) of the
    plugin state attached to a scheduler or its radix cache (``exclude``: SGLang's part of an AROUND hook)."""
    state = attached_state(obj)
    if state is not None:
        dt = time.perf_counter() - t0 - exclude
        state.hook_s += dt
        state.hook_by[key] = state.hook_by.get(key, 0.0) + dt


@functools.lru_cache(maxsize=None)
def _param_names(fn: Callable) -> Tuple[str, ...]:
    """Positional parameter names of ``fn`` (follows functools.wraps, so a hooked method reports SGLang's)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds)


def hook_args(method: Callable, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """The call's arguments by SGLang's parameter names (``method`` is the hooked function, self included).

    Runs on every scheduler step: positional arguments are named from a cached parameter list instead of
    ``Signature.bind_partial`` (a few microseconds less per hook call)."""
    out = dict(zip(_param_names(method), args))
    out.update(kwargs)
    return out


_REQUIRED = object()


@functools.lru_cache(maxsize=None)
def _param_index(fn: Callable, name: str) -> int:
    names = _param_names(fn)
    return names.index(name) if name in names else -1


def hook_arg(
    method: Callable, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], default: Any = _REQUIRED
) -> Any:
    """One argument of a call to the hooked ``method`` by SGLang's parameter name, given the call's positional
    arguments after ``self`` and its keyword arguments: ``hook_args(method, self, *args, **kwargs)[name]`` without
    building the dict (``default`` if given and the call has no such argument, else ``KeyError``)."""
    if name in kwargs:
        return kwargs[name]
    i = _param_index(method, name) - 1  # the parameter list starts with self
    if 0 <= i < len(args):
        return args[i]
    if default is _REQUIRED:
        raise KeyError(name)
    return default


# ---------------------------------------------------------------- request identity
def _classify(req: Any) -> ReqClass:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    role = search = node = None
    if isinstance(params, dict):
        role, search, node = params.get("spex_role"), params.get("spex_search"), params.get("spex_node")
    parsed = parse_rid(getattr(req, "rid", None) or "")
    if parsed is not None:  # the rid carries all three (custom_params can be lost on the way: sglang-router)
        search = search or parsed[0]
        node = node or parsed[1]
        role = role or parsed[2]
    return (ROLE_SPEC if role == ROLE_SPEC else ROLE_PRIMARY), (str(search) if search else None), str(node or "")


def classify(req: Any) -> ReqClass:
    """(role, search id or None, node path) of a scheduler ``Req``; a request without a role is primary."""
    cached = getattr(req, _CLASS_ATTR, None)
    if cached is None:
        cached = _classify(req)
        _set_class(req, cached)
    return cached


def _set_class(req: Any, cls: ReqClass) -> None:
    setattr(req, _CLASS_ATTR, cls)
    setattr(req, _SPEC_ATTR, cls[0] == ROLE_SPEC)


def is_spec(req: Any) -> bool:
    """Whether ``req`` is speculative (called per request per step: one cached attribute read)."""
    flag = getattr(req, _SPEC_ATTR, None)
    return classify(req)[0] == ROLE_SPEC if flag is None else flag


_SPEC_FLAG = operator.attrgetter(_SPEC_ATTR)


def count_spec(reqs: Sequence[Any]) -> int:
    """How many of ``reqs`` are speculative: the cached flags summed in C; a request not classified yet sends the
    count through :func:`is_spec` one by one."""
    try:
        return sum(map(_SPEC_FLAG, reqs))
    except AttributeError:
        pass
    n = 0
    for r in reqs:
        flag = getattr(r, _SPEC_ATTR, None)
        if flag is None:
            flag = is_spec(r)
        if flag:
            n += 1
    return n


def live_roles(
    reqs: Iterable[Any], skip: Optional[Set[int]] = None, searches: Optional[Set[Any]] = None
) -> Tuple[int, int, int]:
    """(speculative, primary, sure) counts of the unfinished requests of ``reqs`` whose ``id`` is not in ``skip``
    (sure: the speculative ones :func:`is_sure`); adds the search of each such primary (its ``id`` outside any
    search) to ``searches`` when given. One pass, roles read from the cached attributes (the gate's census and the
    batch-stats row run it every step)."""
    spec = primary = sure = 0
    for r in reqs:
        if r.finished() or (skip is not None and id(r) in skip):
            continue
        flag = getattr(r, _SPEC_ATTR, None)
        if flag is None:
            flag = is_spec(r)
        if flag:
            spec += 1
            sure += is_sure(r)
        else:
            primary += 1
            if searches is not None:
                searches.add(search_of(r))
    return spec, primary, sure


def search_of(req: Any) -> Any:
    """The search a request belongs to; a request outside any search counts as its own (its ``id``)."""
    cls = getattr(req, _CLASS_ATTR, None)
    if cls is None:
        cls = classify(req)
    return cls[1] or id(req)


def make_primary(req: Any, priority: int) -> None:
    """Re-classify a speculative request as primary with ``priority``."""
    _, search, node = classify(req)
    _set_class(req, (ROLE_PRIMARY, search, node))
    req.priority = priority


def rid(req: Any) -> str:
    return req.rid


def output_len(req: Any) -> int:
    return len(req.output_ids)


def priority(req: Any) -> Optional[int]:
    return req.priority


def set_priority(req: Any, value: int) -> None:
    req.priority = value


def queued_at(req: Any) -> float:
    return req.time_stats.wait_queue_entry_time or 0.0


def is_live(req: Any) -> bool:
    """Not finished and not already marked to finish (by an abort or a finish condition)."""
    return not req.finished() and req.to_finish is None


def finished_by_abort(req: Any) -> bool:
    return isinstance(req.finished_reason, FINISH_ABORT)


def abort_pending(req: Any) -> bool:
    """SGLang's abort path marked this running request (``to_finish``); it would decode one more step."""
    return isinstance(req.to_finish, FINISH_ABORT)


def in_beam_group(req: Any) -> bool:
    return req.beam_group is not None


# ---------------------------------------------------------------- scheduler queries
def priority_scheduling(scheduler: Any) -> bool:
    return bool(scheduler.enable_priority_scheduling)


def low_values_first(scheduler: Any) -> bool:
    return bool(scheduler.schedule_low_priority_values_first)


def overlap(scheduler: Any) -> bool:
    return bool(scheduler.enable_overlap)


def mixes_prefill_with_decode(scheduler: Any, batch: Optional[Any], admitting: Sequence[Any]) -> bool:
    """Whether a prefill of ``admitting`` would run in one forward with ``batch``'s decode step (SGLang's
    mixed chunked prefill, ``--enable-mixed-chunk``; ``get_new_batch_prefill`` mixes only without logprobs)."""
    if not getattr(scheduler, "is_mixed_chunk", False) or batch is None or batch.is_empty():
        return False
    return not batch.return_logprob and not any(r.return_logprob for r in admitting)


def waiting(scheduler: Any) -> List[Any]:
    return scheduler.waiting_queue


def set_waiting(scheduler: Any, reqs: List[Any]) -> None:
    scheduler.waiting_queue = reqs


def running_batch(scheduler: Any) -> Optional[Any]:
    return scheduler.running_batch


def batch_reqs(batch: Optional[Any]) -> List[Any]:
    return list(getattr(batch, "reqs", None) or []) if batch is not None else []


def reqs_view(batch: Optional[Any]) -> Sequence[Any]:
    """``batch``'s requests without a copy (read only; :func:`batch_reqs` for a list the caller may keep)."""
    return (getattr(batch, "reqs", None) or ()) if batch is not None else ()


def chunked_req(scheduler: Any) -> Optional[Any]:
    return scheduler.chunked_req


def nothing_to_admit(scheduler: Any) -> bool:
    """SGLang's prefill step will return no batch before admitting anything: no waiting request, no chunked
    prefill, no grammar request about to be queued (the first checks of ``_get_new_batch_prefill_raw``)."""
    return not scheduler.waiting_queue and scheduler.chunked_req is None and not _waiting_grammars(scheduler)


def _waiting_grammars(scheduler: Any) -> bool:
    gm = getattr(scheduler, "grammar_manager", None)
    return bool(gm is not None and gm.has_waiting_grammars())


def inflight_reqs(scheduler: Any) -> Set[Any]:
    """Requests of the running batch and of the last launched batch (SGLang's own notion, used by its abort)."""
    return scheduler.collect_inflight_reqs()


def scheduled_reqs(running: Optional[Any], last: Optional[Any]) -> List[Any]:
    """Requests a scheduling step can still act on: the running batch, plus a prefill launched last step whose
    requests are merged into the running batch only inside ``get_next_batch_to_run``."""
    reqs = batch_reqs(running)
    if last is not None and last is not running and last.forward_mode.is_extend():
        reqs += batch_reqs(last)
    return reqs


def finishing_inflight(scheduler: Any, batch: Any) -> Set[Any]:
    """Requests whose in-flight result (overlap) finishes them by length: SGLang drops them from the next decode."""
    return set(scheduler._reqs_finishing_inflight(batch))


def last_batch(scheduler: Any) -> Optional[Any]:
    return scheduler.last_batch


def abort_matches(recv_req: Any, req_rid: str) -> bool:
    """SGLang's abort matching: every request, or rids starting with the abort's rid."""
    return bool(recv_req.abort_all or (recv_req.rid and req_rid.startswith(recv_req.rid)))


def abort_rid(recv_req: Any) -> str:
    return recv_req.rid or ""


def abort(scheduler: Any, prefix: str) -> None:
    """SGLang's own abort of every request whose rid starts with ``prefix`` (waiting: now; running: marked)."""
    scheduler.abort_request(AbortReq(rid=prefix))


def sampler(scheduler: Any) -> Optional[Any]:
    """The scheduler's model runner's ``Sampler`` (touch point P23: ``TpModelWorker.model_runner``, whose
    ``sampler`` ``ModelRunner.__init__`` sets). ``tp_worker`` is the target's worker with speculative decoding too
    (SGLang keeps the drafter in ``draft_worker``); None where there is none (a stub scheduler)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    return getattr(runner, "sampler", None)


def pool(scheduler: Any) -> Dict[str, int]:
    """KV pool and queue figures of this scheduler. ``running`` counts the prefill launched last step too: SGLang
    merges it into the running batch only inside the next ``get_next_batch_to_run``, and a control request is
    answered before that (a request in flight there holds KV, so it must not read as idle)."""
    tree = scheduler.tree_cache
    running = [r for r in scheduled_reqs(scheduler.running_batch, scheduler.last_batch) if not r.finished()]
    return {
        "kv_total": int(scheduler.max_total_num_tokens),
        "kv_available": int(scheduler.token_to_kv_pool_allocator.available_size()),
        "kv_evictable": int(tree.evictable_size()),
        "kv_protected": int(tree.protected_size()),
        "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
        "waiting": len(scheduler.waiting_queue),
        "running": len(running),
    }


def kv_figures(scheduler: Any) -> Tuple[int, int, int, int]:
    """(KV pool size, free, evictable, protected) in tokens: the KV part of :func:`pool` (read every step)."""
    tree = scheduler.tree_cache
    return (
        int(scheduler.max_total_num_tokens),
        int(scheduler.token_to_kv_pool_allocator.available_size()),
        int(tree.evictable_size()),
        int(tree.protected_size()),
    )


def kv_total(scheduler: Any) -> int:
    return int(scheduler.max_total_num_tokens)


def admission_shortfall(scheduler: Any, req: Any) -> int:
    """KV tokens the waiting ``req`` lacks for SGLang's prefill admission while nothing runs (0: it fits).

    SGLang's ``PrefillAdder.add_one_req`` charges the uncached prompt (from the prefix ``req`` matched when it was
    last tried; the whole sequence if never) and the output it may still write, ``min(max_new_tokens - output,
    CLIP_MAX_NEW_TOKENS)`` (touch point P24), against the free and evictable KV; its smaller charges (a page of
    per-request overhead is counted here; allocator slot reserves are not) are left to the caller's stall fallback.
    """
    n_fill = len(req.origin_input_ids) + len(req.output_ids)
    extend = max(n_fill - int(req.prefix_len or 0), 0)
    left = max(int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids), 0)
    need = extend + min(left, CLIP_MAX_NEW_TOKENS) + int(scheduler.page_size)
    _, free, evictable, _ = kv_figures(scheduler)
    return max(need + 1 - free - evictable, 0)  # SGLang admits below its budget (check_prefill: total < remaining)


def batch_mode(batch: Any) -> int:
    """1 prefill/extend, 2 decode, 3 mixed, 0 other."""
    fm = batch.forward_mode
    if fm.is_mixed():
        return 3
    if fm.is_decode():
        return 2
    if fm.is_extend():
        return 1
    return 0


def prefilled_reqs(batch: Any) -> List[Any]:
    """The requests an extend batch prefills: a mixed batch's running rows (``decoding_reqs``) left out."""
    decoding = {id(r) for r in (getattr(batch, "decoding_reqs", None) or ())}
    return [r for r in batch_reqs(batch) if id(r) not in decoding]


def prefill_tokens(batch: Any) -> Tuple[int, int, int]:
    """(prompt tokens this batch prefills, of which for speculative requests, requests it decodes). In a mixed
    batch the running batch's rows (``decoding_reqs``) decode; a target-verify batch counts as decode."""
    fm = batch.forward_mode
    if not fm.is_extend() or fm.is_target_verify():
        return 0, 0, len(batch.reqs)
    total = spec = 0
    prefilled = prefilled_reqs(batch)
    for r in prefilled:
        n = int(r.extend_len)
        total += n
        spec += n if is_spec(r) else 0
    return total, spec, len(batch.reqs) - len(prefilled)


def context_tokens(batch: Any) -> int:
    """Tokens of context the batch's requests attend over this step: ``ScheduleBatch.seq_lens_sum``, or the sum of
    ``seq_lens_cpu`` where SGLang left it to be recomputed (a decode step's ``prepare_for_decode``)."""
    total = getattr(batch, "seq_lens_sum", None)
    if total is None:
        lens = getattr(batch, "seq_lens_cpu", None)
        total = lens.sum() if lens is not None else 0
    return int(total)


_SURE_ATTR = "_spex_sure"  # custom_params["spex_sure"], cached beside the role (read per request per step)


def is_sure(req: Any) -> bool:
    """Whether the speculative ``req``'s search expects to use it (``custom_params["spex_sure"]``): the gate lets
    it run above the knee (a hit is work the search would do anyway), within the budget."""
    flag = getattr(req, _SURE_ATTR, None)
    if flag is None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        flag = bool(params.get("spex_sure")) if isinstance(params, dict) else False
        setattr(req, _SURE_ATTR, flag)
    return flag


def worth_s(req: Any) -> Optional[float]:
    """The seconds a speculative request's search expects its hit to save (``custom_params["spex_worth_s"]``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    value = params.get("spex_worth_s") if isinstance(params, dict) else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def search_priority(req: Any) -> Optional[int]:
    """A speculative request's search's primary priority (``custom_params["spex_search_priority"]``; None: unset)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    value = params.get("spex_search_priority") if isinstance(params, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pending_prefill_tokens(req: Any) -> int:
    """Prompt tokens the adder would prefill for ``req`` now (after ``init_next_round_input``'s prefix match)."""
    return max(len(req.full_untruncated_fill_ids) - int(req.prefix_len), 0)


# ---------------------------------------------------------------- acting on requests
def can_finish_now(scheduler: Any, req: Any) -> bool:
    """Whether :func:`finish_now` may end this aborted running request at the scheduling point.

    Excluded: a chunked prefill (SGLang's ``process_pending_chunked_abort`` owns it), beam groups, grammar
    requests (their state advances in result processing), requests without KV, and the subsystems whose
    finish path does more than release the KV row (hierarchical sparse attention, decode KV offload,
    mamba state).
    """
    return (
        abort_pending(req)
        and req is not scheduler.chunked_req
        and req.beam_group is None
        and req.grammar is None
        and req.kv.holds_kv
        and not scheduler.enable_hisparse
        and getattr(scheduler, "decode_offload_manager", None) is None
        and not scheduler.tree_cache.supports_mamba()
    )


def finish_now(scheduler: Any, req: Any) -> None:
    """Finish an aborted running request now, the way SGLang's result processing finishes it one step later:
    ``update_finish_state`` (applies ``to_finish``), ``release_kv_cache`` with checkpoint, completion time,
    the streamed abort. A result of its in-flight batch (overlap) is then skipped by SGLang (finished)."""
    req.update_finish_state()
    release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
    req.time_stats.set_completion_time()
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def retract(batch: Any, victims: Iterable[Any]) -> List[Any]:
    """Take ``victims`` out of the running ``batch`` and free their KV, as SGLang's priority preemption does
    (``ScheduleBatch.release_req`` per request, then ``filter_batch``); returns them for :func:`requeue`."""
    drop = set(victims)
    if not drop:
        return []
    keep, released, out = [], 0, []
    for i, r in enumerate(batch.reqs):
        if r in drop:
            released += 1
            batch.release_req(i, len(batch.reqs) - released)
            out.append(r)
        else:
            keep.append(i)
    if out:
        batch.filter_batch(keep_indices=keep)
        batch.batch_is_full = False
    return out


def requeue(scheduler: Any, reqs: Sequence[Any]) -> None:
    """Put retracted requests back in the waiting queue (SGLang's ``_add_request_to_queue``)."""
    for r in reqs:
        scheduler._add_request_to_queue(r, is_retracted=True)


def preempt_for(adder: Any, req: Any) -> bool:
    """SGLang's own priority preemption of lower-ranked running requests to make room for ``req``, then ``req``'s
    prefix matched again, as SGLang's admission loop does after it preempts: releasing the preempted requests
    changes the radix tree, and a retry that locked the old ``req.last_node`` found it gone (KeyError in
    ``inc_lock_ref``: the scheduler died, CI once)."""
    if not adder.preempt_to_schedule(req):
        return False
    req.init_next_round_input(adder.tree_cache)
    return True


def adder_running_reqs(adder: Any) -> List[Any]:
    return batch_reqs(adder.running_batch)


def adder_can_run(adder: Any) -> List[Any]:
    """Requests the adder admitted so far this step."""
    return adder.can_run_list


def adder_tree_cache(adder: Any) -> Any:
    return adder.tree_cache

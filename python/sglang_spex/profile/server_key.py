"""The cache key of a server's roofline profile: its model, its device and the server flags that change decode step
times (:func:`profile_key`, from ``/get_server_info`` or ``tokenizer_manager.server_args``)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from sglang_spex.profile.cache import device_name

SWEEP_CEILING = 512  # the largest batch a roofline sweep measures by default (``ProfileSpec.max_batch``)

# Server flags (SGLang 0.5.23 ``ServerArgs`` fields) that change decode step times or the batch a step can run; they
# (with the model and device) key the cache.
KEY_FLAGS = (
    "device",
    "dtype",
    "revision",  # the model's weights, with ``model_path``
    "attention_backend",
    "sampling_backend",
    "tp_size",
    "dp_size",
    "pp_size",
    "attn_dp_size",  # what ``--enable-dp-attention`` resolves to
    "quantization",
    "kv_cache_dtype",
    "disable_cuda_graph",
    "disable_decode_cuda_graph",
    "cuda_graph_backend_decode",
    "cuda_graph_max_bs_decode",
    "cuda_graph_bs_decode",
    "enable_torch_compile",
    "torch_compile_max_bs",
    "disable_overlap_schedule",
    "chunked_prefill_size",
    "max_running_requests",
    "max_total_tokens",  # the KV pool (with the two below): past its room the sweep flattens
    "mem_fraction_static",
    "page_size",
    "enable_deterministic_inference",
    "speculative_algorithm",  # with speculation a decode step drafts and verifies
    "speculative_draft_model_path",
    "speculative_draft_model_revision",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)
# SGLang's request-queue cap: a burst of more requests than it holds is refused (503), so the sweep stops there. In
# the key only when set (it bounds the sweep, as max_running_requests does), so uncapped servers keep their profiles.
QUEUE_CAP_FLAG = "max_queued_requests"


def profile_key(server_args: Dict[str, Any], device: Optional[str] = None) -> Dict[str, Any]:
    """Cache key from SGLang's server args (``/get_server_info`` or ``tokenizer_manager.server_args``)."""
    flags = {k: _json_flag(server_args.get(k)) for k in KEY_FLAGS}
    cap = server_args.get(QUEUE_CAP_FLAG)
    if cap and int(cap) < SWEEP_CEILING:  # a cap the sweep cannot reach changes nothing measured
        flags[QUEUE_CAP_FLAG] = cap
    return {"model": str(server_args.get("model_path")), "hardware": device or device_name(), "flags": flags}


def _json_flag(value: Any) -> Any:
    """A flag's value as the cache file holds it (a tuple as a list), so a loaded key compares equal."""
    return list(value) if isinstance(value, tuple) else value


def server_args_dict(server_args: Any) -> Dict[str, Any]:
    """The fields :func:`profile_key` reads, from SGLang's ``ServerArgs`` (a dict is taken as it is)."""
    if isinstance(server_args, dict):
        return server_args
    return {k: getattr(server_args, k, None) for k in ("model_path", QUEUE_CAP_FLAG) + KEY_FLAGS}

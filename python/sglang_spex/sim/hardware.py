"""Devices and models the simulator knows, as documented data (sources next to each number).

Peak numbers are vendor datasheet values (dense, no structured sparsity). What an engine actually reaches
is a fraction of them: :class:`Device` carries ``bw_eff`` / ``flops_eff`` (defaults are *our assumptions*,
typical of well-tuned LLM decode kernels, not measurements; calibrate them with a real profile where one
exists). Model numbers come from each model's published ``config.json``; counts are recomputed from the
architecture where the card rounds them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict

GB = 1e9
TFLOPS = 1e12

# Assumed achievable fractions of peak (not measured here): decode GEMV/attention kernels typically
# reach ~80% of HBM bandwidth; large-batch bf16 GEMMs ~60-70% of tensor-core peak.
DEFAULT_BW_EFF = 0.8
DEFAULT_FLOPS_EFF = 0.65
# Per-step fixed cost (scheduler + kernel launches with CUDA graphs), assumed ~4 ms for SGLang on GPU.
DEFAULT_STEP_OVERHEAD_S = 0.004


@dataclass(frozen=True)
class Device:
    name: str
    mem_bw: float  # bytes/s, peak
    peak_flops: float  # bf16 dense FLOP/s, peak
    memory: float  # bytes
    bw_eff: float = DEFAULT_BW_EFF
    flops_eff: float = DEFAULT_FLOPS_EFF
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    source: str = ""

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the effective roofline turns compute-bound."""
        return (self.peak_flops * self.flops_eff) / (self.mem_bw * self.bw_eff)


DEVICES: Dict[str, Device] = {
    # NVIDIA A100 80GB SXM datasheet: HBM2e 2,039 GB/s; BF16 tensor 312 TFLOPS dense (624 sparse).
    "A100-80G": Device("A100-80G", 2039 * GB, 312 * TFLOPS, 80 * GB, source="NVIDIA A100 datasheet (SXM 80GB)"),
    # NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s; BF16 tensor 989 TFLOPS dense (1,979 sparse).
    "H100": Device("H100", 3350 * GB, 989 * TFLOPS, 80 * GB, source="NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA RTX A6000 datasheet: GDDR6 768 GB/s, 48 GB; tensor 309.7 TFLOPS with sparsity → 154.8 dense.
    "A6000": Device("A6000", 768 * GB, 154.8 * TFLOPS, 48 * GB, source="NVIDIA RTX A6000 datasheet"),
    # NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s, 141 GB; BF16 tensor 989 TFLOPS dense (same die as H100).
    "H200": Device("H200", 4800 * GB, 989 * TFLOPS, 141 * GB, source="NVIDIA H200 datasheet (SXM)"),
}


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # total parameters
    active_params: float  # parameters touched per token (== params for dense models)
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16
    # MoE: experts per layer, experts per token, parameters of one expert (0 for dense models)
    experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    source: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def attn_flops_per_ctx_token(self) -> float:
        """Decode attention FLOPs per (new token × context token): QKᵀ and PV, 2 FLOPs per MAC each."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def expert_fraction_touched(self, tokens: float) -> float:
        """Expected fraction of a layer's experts hit by ``tokens`` tokens (uniform routing assumed)."""
        if not self.experts:
            return 1.0
        p_miss = (1.0 - self.experts_per_token / self.experts) ** max(tokens, 0.0)
        return 1.0 - p_miss

    def weight_bytes_read(self, tokens: float) -> float:
        """Bytes of weights one forward pass over ``tokens`` tokens reads (MoE: only experts hit)."""
        if not self.experts:
            return self.weight_bytes
        expert_total = self.expert_params * self.experts * self.layers
        dense = self.params - expert_total
        return (dense + expert_total * self.expert_fraction_touched(tokens)) * self.dtype_bytes


MODELS: Dict[str, Model] = {
    # Llemma-7B = Code Llama 7B arch (EleutherAI/llemma_7b config.json): 32 layers, hidden 4096, 32 heads,
    # MHA (32 KV heads), head_dim 128, vocab 32016; 6.74B parameters.
    "Llemma-7B": Model("Llemma-7B", 6.74e9, 6.74e9, 32, 4096, 32, 32, 128, source="EleutherAI/llemma_7b config.json"),
    # Llemma-34B = Code Llama 34B arch (EleutherAI/llemma_34b): 48 layers, hidden 8192, 64 heads, GQA with
    # 8 KV heads, head_dim 128; 33.7B parameters.
    "Llemma-34B": Model("Llemma-34B", 33.7e9, 33.7e9, 48, 8192, 64, 8, 128, source="EleutherAI/llemma_34b config.json"),
    # DeepSeek-R1-Distill-Llama-8B (Llama-3.1-8B arch): 32 layers, hidden 4096, 32 heads, 8 KV heads,
    # head_dim 128; 8.03B parameters. (The paper's "R1-Distill 8B"; R1-0528-Qwen3-8B has 36 layers and the
    # same GQA shape, so its roofline is within ~10% of this one.)
    "DeepSeek-R1-Distill-8B": Model(
        "DeepSeek-R1-Distill-8B",
        8.03e9,
        8.03e9,
        32,
        4096,
        32,
        8,
        128,
        source="deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim 128,
    # 128 experts, 8 per token, moe_intermediate 768 → one expert = 3·2048·768 = 4.72M params;
    # 30.5B total, 3.3B active (model card).
    "Qwen3-30B-A3B": Model(
        "Qwen3-30B-A3B",
        30.5e9,
        3.3e9,
        48,
        2048,
        32,
        4,
        128,
        experts=128,
        experts_per_token=8,
        expert_params=3 * 2048 * 768,
        source="Qwen/Qwen3-30B-A3B config.json + model card",
    ),
}


def get_device(name: str, **overrides) -> Device:
    try:
        dev = DEVICES[name]
    except KeyError:
        raise KeyError(f"unknown device {name!r}; known: {sorted(DEVICES)} (or 'cpu-measured' via a profile)")
    return replace(dev, **overrides) if overrides else dev


def get_model(name: str) -> Model:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")

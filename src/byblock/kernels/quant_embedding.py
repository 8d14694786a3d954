"""An input embedding read from a tied LM head's quantized blocks: no float table held.

SmolLM2's GGUF stores its tied embedding once, as the head's Q8_0 blocks; the de-quantized checkpoint holds it
again as a 49K x 576 fp32 table (108 MiB), paged in row by row as tokens are seen. Looking rows up from the blocks
the head already keeps resident gives the same floats (Q8_0 de-quantizes exactly in fp32) and holds nothing more.
"""

from __future__ import annotations

import torch
from torch import nn

from byblock.kernels.quant_gemm import QuantWeight


class QuantEmbedding(nn.Module):
    """Drop-in for a plain nn.Embedding whose table equals `qweight.dequantize()` (checked once, when the blocks
    cache is built: models/gguf_weights.py)."""

    def __init__(self, qweight: QuantWeight, padding_idx: int | None = None) -> None:
        super().__init__()
        self.qweight = qweight  # the head's, shared: not a copy
        self.num_embeddings, self.embedding_dim = qweight.out_features, qweight.in_features
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> fp32 [..., H]."""
        return self.qweight.rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, de-quantized into a fresh fp32 tensor (108 MiB for SmolLM2: for training and export,
        not for lookups)."""
        return self.qweight.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.qweight.bits} blocks of the LM head"


def embed_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the raw table (no in-module scale such as Gemma's): what drafters embed their tokens with."""
    if isinstance(embedding, QuantEmbedding):
        return embedding(ids)
    return nn.functional.embedding(ids, embedding.weight)

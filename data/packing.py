"""Documents inside a packed sample: which document each token belongs to, and its position in it.

Megatron's rule (--reset-position-ids, --reset-attention-mask): an end-of-document token ends its
document, the token after it starts the next one. With --reset-attention-mask no token attends
to another document's tokens; with --reset-position-ids positions restart at 0 in each document.
A packed SFT sample gives its documents directly (data/sft_dataset.py "document_ids").
"""
from __future__ import annotations

import torch


def documents_after_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Document ids [b, s] of input tokens [b, s]: the count of end-of-document tokens before each."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document [b, s] (documents are runs of equal ids)."""
    s = document_ids.shape[1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # the index of the latest document start at or before each token
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first

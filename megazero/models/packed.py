"""Packed documents: several documents in one sample, each attending only to itself, positions restarting.

The data marks each input position with its document (``doc_ids`` (b, s), counting up within the sample,
`megazero.data.dataset`) and ignores the labels that cross a document boundary. The model then:

- attends within documents: a query sees the keys at or before it in its own document (block-diagonal causal;
  `document_mask`, and the context-parallel cores mask by the same ids);
- positions each token within its document (`positions_in_documents`), for RoPE and learned positions, so
  that a document's tokens get exactly the positions they would have alone.

`PackedDocuments` is one model's holder of the micro-batch being computed: the pipeline stage sets it from the
micro-batch before running its layers (every stage loads the micro-batch for it), and the layers read it
through `current`, which a recompute region (activation checkpointing) records in its forward and replays in
its recompute, when another micro-batch may have been set meanwhile. Local: no communication.
"""
from __future__ import annotations

import torch


def positions_in_documents(docs: torch.Tensor) -> torch.Tensor:
    """(b, s) positions of each token within its document: 0 at each document's first token, counting up."""
    s = docs.shape[-1]
    index = torch.arange(s, device=docs.device).expand_as(docs)
    first = torch.ones_like(docs, dtype=torch.bool)
    first[..., 1:] = docs[..., 1:] != docs[..., :-1]  # a document starts here
    start = torch.where(first, index, torch.zeros_like(index)).cummax(dim=-1).values  # its first position
    return index - start


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) boolean: query i may attend key j (j <= i, the same document), for SDPA's attn_mask."""
    s = docs.shape[-1]
    pos = torch.arange(s, device=docs.device)
    causal = pos.view(1, s) <= pos.view(s, 1)  # (s_q, s_k)
    return (causal & (docs.unsqueeze(-1) == docs.unsqueeze(-2))).unsqueeze(1)


class PackedDocuments:
    """The document ids of the micro-batch a model's stage is computing (see the module docstring)."""

    def __init__(self):
        self._docs: torch.Tensor | None = None

    def set_batch(self, batch: dict) -> None:
        """Take ``batch["doc_ids"]`` (b, s) as the documents of what runs next."""
        docs = batch.get("doc_ids") if isinstance(batch, dict) else None
        if docs is None:
            raise ValueError("data.packed_documents: the micro-batch has no 'doc_ids' (the document of each "
                             "position); megazero's data iterator adds them, a user's must too")
        self._docs = docs

    def current(self, decisions=None, key: str = "docs") -> torch.Tensor:
        """The current micro-batch's document ids, (b, s); inside a recompute region of `decisions` (the
        checkpointer's `Decisions`), the ids its forward saw."""
        if decisions is None:
            return self._docs
        return decisions.remember(key, lambda: self._docs)

"""Rotary position embeddings (rotate-half convention of GPT-NeoX/Llama): tables and their application."""
from __future__ import annotations

import torch


class RopeTables:
    """cos and sin tables of one model's RoPE (head dim `dim`, base `theta`), built once per device and
    dtype for the longest sequence seen and sliced for shorter ones. One instance per model, shared by its
    layers (the LayerContext holds it): a per-call rebuild costs an outer product and two
    transcendental passes per layer."""

    def __init__(self, dim: int, theta: float):
        self.dim, self.theta = dim, theta
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, seq: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (seq, dim), in `dtype` on `device` (computed in fp32, then cast)."""
        key = (torch.device(device), dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < seq:
            with torch.inference_mode(False):  # built under inference_mode, they could never train again
                cos, sin = rope_cos_sin(seq, self.dim, self.theta, device)
                cached = self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return cached[0][:seq], cached[1][:seq]


def rope_cos_sin(seq: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq, dim) for positions 0..seq-1 (halves repeated, as HF Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)  # (seq, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (seq, dim)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (b, heads, seq, d) by position: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

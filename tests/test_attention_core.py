"""The fused attention core (SDPA) against the explicit reference core, and the cached RoPE tables.

Both cores of one `SelfAttention` get the same q, k, v (b, a, s, d) / (b, kv, s, d) and the same output
gradient; outputs and the gradients of q, k and v must agree within 1e-6 relative (max|a − b| / max|b|,
fp32). Cases: causal (learned positions), ALiBi, grouped-query (llama: kv < heads, RoPE), multi-query
(kv = 1), at the spec's sequence and at a shorter one. The model picks the fused core unless attention
dropout is active in training (then the reference core draws megazero's layout-independent masks).
"""
import pytest
import torch

from megazero.core.spec import load_spec
from megazero.models import RopeTables, layer_builders, rope_cos_sin
from megazero.runtime.comm import single_rank_group
from tests.test_spec import SPECS

TOL = 1e-6
CASES = {  # name -> (spec file:flavor, overrides)
    "causal": ("gpt.py:debug", None),
    "alibi": ("gpt.py:debug-alibi", None),
    "gqa": ("llama.py:debug", None),
    "mqa": ("llama.py:debug", {"kv_heads": 1}),
}


def attention_of(case, **overrides):
    ref, base = CASES[case]
    spec = load_spec(SPECS + ref, {**(base or {}), **overrides})
    block = layer_builders(spec, single_rank_group(), seed=3)[1](None)
    return spec, block.attn


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def qkv(spec, seq, b=2):
    gen = torch.Generator().manual_seed(7)
    d = spec.head_dim
    q = torch.randn(b, spec.heads, seq, d, generator=gen)
    k = torch.randn(b, spec.num_kv_heads, seq, d, generator=gen)
    v = torch.randn(b, spec.num_kv_heads, seq, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("short", [False, True])
def test_sdpa_core_equals_reference_core(case, short):
    spec, attn = attention_of(case)
    if case == "gqa":
        assert spec.num_kv_heads < spec.heads  # the flavor really is grouped-query
    seq = spec.seq_len // 2 + 1 if short else spec.seq_len
    grad_out = torch.randn(2, spec.heads, seq, spec.head_dim, generator=torch.Generator().manual_seed(8))
    results = []
    for core in (attn.sdpa_core, attn.reference_core):
        q, k, v = (t.requires_grad_() for t in qkv(spec, seq))
        out = core(q, k, v)
        out.backward(grad_out)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (out, *grads), (ref_out, *ref_grads) = results
    assert out.shape == (2, spec.heads, seq, spec.head_dim)
    assert rel(out, ref_out) <= TOL, (case, rel(out, ref_out))
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert rel(g, r) <= TOL, (case, name, rel(g, r))


def test_sdpa_core_is_causal():
    """Changing the last position's k and v leaves every earlier output unchanged."""
    spec, attn = attention_of("alibi")
    q, k, v = qkv(spec, spec.seq_len)
    out = attn.sdpa_core(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 1.0
    v2[:, :, -1] -= 1.0
    out2 = attn.sdpa_core(q, k2, v2)
    assert torch.equal(out[:, :, :-1], out2[:, :, :-1])
    assert not torch.equal(out[:, :, -1], out2[:, :, -1])


def test_model_uses_reference_core_only_while_attention_dropout_is_active(monkeypatch):
    spec, attn = attention_of("causal", attention_dropout=0.1)
    calls = []
    monkeypatch.setattr(attn, "sdpa_core", lambda q, k, v: calls.append("sdpa") or q)
    monkeypatch.setattr(attn, "reference_core", lambda q, k, v: calls.append("reference") or q)
    x = torch.randn(spec.seq_len, 2, spec.hidden)  # (s, b, h)
    attn.train()
    attn(x)
    attn.eval()
    attn(x)
    _, plain = attention_of("causal")
    monkeypatch.setattr(plain, "sdpa_core", lambda q, k, v: calls.append("sdpa") or q)
    plain.train()
    plain(x)
    assert calls == ["reference", "sdpa", "sdpa"]


def test_rope_tables_are_built_once_and_shared():
    spec = load_spec(SPECS + "llama.py:debug")
    builders = layer_builders(spec, single_rank_group(), seed=3)
    a, b = builders[1](None).attn, builders[2](None).attn
    assert a.rope is b.rope  # one table per model
    tables = RopeTables(spec.head_dim, spec.rope_theta)
    cos, sin = tables.get(16, torch.device("cpu"), torch.float32)
    ref_cos, ref_sin = rope_cos_sin(16, spec.head_dim, spec.rope_theta, "cpu")
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    short_cos, _ = tables.get(5, torch.device("cpu"), torch.float32)
    assert short_cos.data_ptr() == cos.data_ptr() and torch.equal(short_cos, ref_cos[:5])  # sliced, not rebuilt
    long_cos, _ = tables.get(40, torch.device("cpu"), torch.float32)
    assert torch.equal(long_cos[:16], ref_cos) and long_cos.shape == (40, spec.head_dim)
    half, _ = tables.get(16, torch.device("cpu"), torch.bfloat16)
    assert half.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh runs it)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_core_on_cuda_in_bf16_matches_the_fp32_reference(case):
    """The flash / memory-efficient kernels in bf16 against the explicit core in fp32 (bf16's 8-bit
    mantissa: 2e-2 relative)."""
    spec, attn = attention_of(case)
    attn = attn.cuda()
    q, k, v = (t.cuda() for t in qkv(spec, spec.seq_len))
    ref = attn.reference_core(q, k, v)
    out = attn.sdpa_core(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    # the docstring: bf16's 8-bit mantissa (2^-8 = 3.9e-3 per rounding) over the core's few roundings
    assert rel(out, ref) <= 2e-2, (case, rel(out, ref))


def test_rope_tables_built_under_inference_mode_still_train():
    spec, attn = attention_of("gqa")
    x = torch.randn(spec.seq_len, 2, spec.hidden)  # (s, b, h)
    with torch.inference_mode():
        attn(x)  # the first call builds the tables
    attn(x.requires_grad_()).sum().backward()  # they can be saved for backward
    assert x.grad is not None


def test_alibi_mask_is_built_once_per_model_and_a_fused_kernel_takes_it():
    """ALiBi's float mask: one per model (shared by the layers), built once for a sequence length, dtype
    and device however many layers and micro-batches run; 4-D, so SDPA's flash kernel (CPU) takes it
    where the old 3-D mask sent every call to the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = load_spec(SPECS + "gpt.py:debug-alibi")
    builders = layer_builders(spec, single_rank_group(), seed=3)
    a, b = builders[1](None).attn, builders[2](None).attn
    assert a.alibi_mask is b.alibi_mask
    q, k, v = qkv(spec, 16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no math fallback allowed
        for _ in range(3):  # micro-batches
            outs = [attn.sdpa_core(q, k, v) for attn in (a, b)]
    assert a.alibi_mask.builds == 1
    # fp32 flash kernel with the float mask vs the explicit core: another summation order over the keys (~80 ulps)
    assert rel(outs[0], a.reference_core(q, k, v)) < 1e-5

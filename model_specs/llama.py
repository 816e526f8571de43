"""Llama family specs: pre-RMSNorm, SwiGLU MLP, rotary positions (RoPE), grouped-query attention
(kv_heads < heads), no biases, untied output head.

Load with `megazero.core.spec.load_spec("model_specs/llama.py:<flavor>", overrides)`.

Any other Llama is a flavor plus ``key=value`` overrides (every ModelSpec field can be given), e.g.
Llama-3 405B from the debug flavor:

    model_specs/llama.py:debug layers=126 hidden=16384 heads=128 kv_heads=8 ffn_hidden=53248 vocab=128256 seq_len=8192 rope_theta=500000

Published sizes, counted by `megazero.models.count_params` on the meta device (tests/test_model_specs_100b.py):
llama3-8b 8,030,261,248, llama3-70b 70,553,706,496, llama3-405b 405,853,388,800 (from their configs).
"""
from megazero.core.spec import ModelSpec


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int = 32000,
          seq_len: int = 4096, **kw) -> ModelSpec:
    return ModelSpec(family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=ffn_hidden, vocab=vocab, seq_len=seq_len, norm="rmsnorm", activation="swiglu",
                     position="rope", tie_embeddings=False, bias=False, eps=kw.pop("eps", 1e-5),
                     scaled_init=False, **kw)


FLAVORS = {
    # 8 CPU ranks run a step of this in well under a second; kv_heads=4 allows tp up to 4.
    "debug": llama(layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=512, seq_len=32),
    # Mixture of Experts, debug size. Mixtral-style: every MLP 8 SwiGLU experts, top-2, softmax router.
    "debug-moe": llama(layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=512, seq_len=32,
                       moe_num_experts=8, moe_top_k=2, moe_ffn=64),
    # DeepSeek-style: fine-grained routed experts (16 narrow ones, top-4, sigmoid scores renormalised
    # over the 4) plus one shared expert every token goes through.
    "debug-deepseek": llama(layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=512, seq_len=32,
                            moe_num_experts=16, moe_top_k=4, moe_ffn=32, moe_score="sigmoid",
                            moe_shared_experts=1, moe_shared_ffn=64),
    "mixtral-8x7b": llama(32, 4096, 32, 8, 14336, seq_len=32768, rope_theta=1e6, moe_num_experts=8, moe_top_k=2),
    "llama2-7b": llama(32, 4096, 32, 32, 11008),
    "llama2-13b": llama(40, 5120, 40, 40, 13824),
    "llama2-70b": llama(80, 8192, 64, 8, 28672),
    "llama3-8b": llama(32, 4096, 32, 8, 14336, vocab=128256, seq_len=8192, rope_theta=500000.0),
    "llama3-70b": llama(80, 8192, 64, 8, 28672, vocab=128256, seq_len=8192, rope_theta=500000.0),
    "llama3-405b": llama(126, 16384, 128, 8, 53248, vocab=128256, seq_len=8192, rope_theta=500000.0),
}

"""GPT-2 / GPT-3 family specs: pre-LayerNorm, GeLU (tanh approximation, GPT-2's "gelu_new") MLP of 4h,
learned positions (or ALiBi, as BLOOM), biases everywhere, input and output embedding tied.

Load with `megazero.core.spec.load_spec("model_specs/gpt.py:<flavor>", overrides)`.
"""
from megazero.core.spec import ModelSpec


def gpt(layers: int, hidden: int, heads: int, vocab: int = 50257, seq_len: int = 1024, **kw) -> ModelSpec:
    return ModelSpec(family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len,
                     norm="layernorm", activation="gelu_tanh", position=kw.pop("position", "learned"),
                     tie_embeddings=True, bias=True, eps=1e-5, **kw)


FLAVORS = {
    # 8 CPU ranks (up to tp=8) run a step of this in well under a second.
    "debug": gpt(layers=2, hidden=64, heads=8, vocab=512, seq_len=32),
    "debug-alibi": gpt(layers=2, hidden=64, heads=8, vocab=512, seq_len=32, position="alibi"),
    "gpt2-small": gpt(12, 768, 12, dropout=0.1, attention_dropout=0.1),
    "gpt2-medium": gpt(24, 1024, 16, dropout=0.1, attention_dropout=0.1),
    "gpt2-large": gpt(36, 1280, 20, dropout=0.1, attention_dropout=0.1),
    "gpt2-xl": gpt(48, 1600, 25, dropout=0.1, attention_dropout=0.1),
    # Megatron-LM (Narayanan et al. 2021) Table 1 rows, s = 2048; V = 51200 as in the paper.
    "gpt-1.7b": gpt(24, 2304, 24, vocab=51200, seq_len=2048),
    "gpt-7.5b": gpt(36, 4096, 32, vocab=51200, seq_len=2048),
    "gpt-39b": gpt(48, 8192, 64, vocab=51200, seq_len=2048),
    "gpt3-175b": gpt(96, 12288, 96, vocab=51200, seq_len=2048),
    "bloom-176b": gpt(70, 14336, 112, vocab=250880, seq_len=2048, position="alibi"),
}

"""GPT-2 / GPT-3 family specs: pre-LayerNorm, GeLU (tanh approximation, GPT-2's "gelu_new") MLP of 4h,
learned positions (or ALiBi, as BLOOM), biases everywhere, input and output embedding tied.

Load with `megazero.core.spec.load_spec("model_specs/gpt.py:<flavor>", overrides)`.

Any other GPT is a flavor plus ``key=value`` overrides (every ModelSpec field can be given), e.g.
GPT-3 175B from the debug flavor, or a BLOOM-like model from ``debug-bloom``:

    model_specs/gpt.py:debug layers=96 hidden=12288 heads=96 vocab=51200 seq_len=2048
    model_specs/gpt.py:debug-bloom layers=24 hidden=2048 heads=16 vocab=250880 seq_len=2048

Published sizes, counted by `megazero.models.count_params` on the meta device (tied embeddings once,
vocabulary unpadded; tests/test_model_specs_100b.py): gpt3-175b 174.6B (V = 51200, as Megatron-LM),
bloom-176b 176,247,271,424 (exactly BLOOM's), mt-nlg-530b 529.6B (V = 51200).
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
    # BLOOM's architecture at debug size: ALiBi and the LayerNorm right after the word embedding.
    "debug-bloom": gpt(layers=2, hidden=64, heads=8, vocab=512, seq_len=32, position="alibi", embedding_norm=True),
    "gpt2-small": gpt(12, 768, 12, dropout=0.1, attention_dropout=0.1),
    "gpt2-medium": gpt(24, 1024, 16, dropout=0.1, attention_dropout=0.1),
    "gpt2-large": gpt(36, 1280, 20, dropout=0.1, attention_dropout=0.1),
    "gpt2-xl": gpt(48, 1600, 25, dropout=0.1, attention_dropout=0.1),
    # Megatron-LM (Narayanan et al. 2021) Table 1 rows, s = 2048; V = 51200 as in the paper.
    "gpt-1.7b": gpt(24, 2304, 24, vocab=51200, seq_len=2048),
    "gpt-7.5b": gpt(36, 4096, 32, vocab=51200, seq_len=2048),
    "gpt-39b": gpt(48, 8192, 64, vocab=51200, seq_len=2048),
    "gpt3-175b": gpt(96, 12288, 96, vocab=51200, seq_len=2048),
    # BigScience BLOOM (2022): ALiBi, word_embeddings_layernorm; 250880 = 250680 tokens padded (HF config).
    "bloom-176b": gpt(70, 14336, 112, vocab=250880, seq_len=2048, position="alibi", embedding_norm=True),
    # Megatron-Turing NLG 530B (Smith et al. 2022): 105 layers, h = 20480, 128 heads, s = 2048; V = 51200.
    "mt-nlg-530b": gpt(105, 20480, 128, vocab=51200, seq_len=2048),
}

"""megazero.core.flops, the one count of a model's FLOPs: Megatron's closed form for GPT, hand counts of
Llama-3 405B and Mixtral 8x7B term by term, the planner's timed GEMMs doing the same work, and the
trainer's printed MFU and the planner's predicted MFU reading the same number for one debug run."""
from __future__ import annotations

import json

import pytest

from megazero.core import flops
from megazero.core.spec import ModelSpec, load_spec
from megazero.core.spec_partition import layer_infos, layer_kinds
from megazero.planner import published
from megazero.planner.block_cost import block_cost, embedding_head_cost
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout
from megazero.planner.machine import DEFAULT_EFFICIENCY, MEGATRON_SC21, MEGAZERO, Machine
from megazero.planner.moe_plan import active_params
from megazero.planner.speed import predict_step, step_flops
from tests.harness import run_ranks

A100 = load_hardware("a100-80gb", "configs/hardware")
LLAMA3_405B = load_spec("model_specs/llama.py:llama3-405b")
MIXTRAL = load_spec("model_specs/llama.py:mixtral-8x7b")


# -- Megatron's closed form for GPT ----------------------------------------------------------------------------
#
# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC21), appendix "Floating-Point Operations": a layer's forward is 24·B·s·h² (the q, k, v and out
# projections 8·B·s·h², the 4h MLP 16·B·s·h²) plus 4·B·s²·h (QKᵀ and the scores times V, the whole s x s
# square), the logits 2·B·s·h·V; backward is twice the forward and the full recompute one more forward of
# the layers (not of the logits), which gives the paper's F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
# Without the recompute, 3 passes of the layers: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) model FLOPs.

def _megatron(b, s, l, h, v) -> tuple[float, float]:
    return (72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
            96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))


GPTS = [load_spec("model_specs/gpt.py:debug"),
        load_spec("model_specs/gpt.py:debug", {"layers": 7, "hidden": 96, "heads": 3, "vocab": 1234, "seq_len": 80}),
        *(run.spec() for run in published.CALIBRATION)]


@pytest.mark.parametrize("spec", GPTS, ids=lambda s: f"l{s.layers}h{s.hidden}s{s.seq_len}")
def test_gpt_is_megatrons_closed_form(spec):
    b, s, l, h, v = 8, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    model, hardware = _megatron(b, s, l, h, v)
    # rel 1e-12: the closed form regroups the same products; float64 rounding only
    assert flops.model_flops_per_step(spec, b) == pytest.approx(model, rel=1e-12)
    assert flops.hardware_flops_per_step(spec, b, "full") == pytest.approx(hardware, rel=1e-12)
    assert flops.hardware_flops_per_step(spec, b, "none") == flops.model_flops_per_step(spec, b)
    # selective recompute: the attention core's 4·B·s²·h once more per layer
    assert flops.hardware_flops_per_step(spec, b, "selective") == pytest.approx(model + 4 * b * s * s * h * l,
                                                                                 rel=1e-12)


def test_the_planners_published_rows_count_megatrons_flops():
    for run in published.CALIBRATION:
        spec, layout = run.spec(), run.layout()
        model, hardware = _megatron(layout.global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab)
        got = step_flops(spec, layout)
        assert layout.recompute == "full"  # Table 1's runs; their TFLOP/s are the 96·... formula's
        assert got[0] == pytest.approx(model, rel=1e-12) and got[1] == pytest.approx(hardware, rel=1e-12)  # float64


# -- hand counts ---------------------------------------------------------------------------------------------

def test_llama3_405b_hand_count():
    spec = LLAMA3_405B
    assert (spec.layers, spec.hidden, spec.heads, spec.num_kv_heads, spec.ffn, spec.vocab, spec.seq_len,
            spec.activation, spec.tie_embeddings) == (126, 16384, 128, 8, 53248, 128256, 8192, "swiglu", False)
    h, d, s = 16384, 128, 8192
    q = 2 * h * 128 * d          # 536,870,912: q, h x 128 heads of 128
    k = v = 2 * h * 8 * d        # 33,554,432 each: 8 key/value heads of 128
    o = 2 * 128 * d * h          # 536,870,912
    core = 2 * s * 128 * d + 2 * s * 128 * d  # QKᵀ and PV over all 8192 keys: 536,870,912
    mlp = 3 * 2 * h * 53248      # gate, up, down: 5,234,491,392
    block = q + k + v + o + core + mlp
    assert block == 6_912_212_992
    head = 2 * h * 128256        # the untied logits GEMM: 4,202,692,608; the input embedding is a lookup
    forward = 126 * block + head
    assert forward == 875_141_529_600
    assert flops.block_forward(spec) == flops.BlockFlops(qkv=q + k + v, out=o, core=core, mlp=mlp)
    assert flops.forward_per_token(spec) == forward
    assert flops.model_flops_per_token(spec) == 3 * forward == 2_625_424_588_800
    # the commonly cited 6·N + 12·L·h·s (PaLM's appendix B) with N = 405,853,388,800 (the published count,
    # tests/test_model_specs_100b.py): N holds the untied input embedding (V·h) and the norms' weights
    # (two per block and the final one), which no GEMM multiplies; less those, the two counts are equal
    n = 405_853_388_800
    not_in_gemms = 128256 * h + (2 * 126 + 1) * h
    assert flops.model_flops_per_token(spec) == 6 * (n - not_in_gemms) + 12 * 126 * h * s
    # the planner's per-layer count is this one too (it was about 15% below the trainer's 8·h² projections)
    assert flops.layer_flops_per_token(spec, "block") == 3 * block


def test_mixtral_8x7b_hand_count():
    spec = MIXTRAL
    assert (spec.layers, spec.hidden, spec.heads, spec.num_kv_heads, spec.moe.ffn, spec.moe.num_experts,
            spec.moe.top_k, spec.vocab, spec.tie_embeddings) == (32, 4096, 32, 8, 14336, 8, 2, 32000, False)
    h, d, s = 4096, 128, spec.seq_len
    qkv = 2 * h * 32 * d + 2 * 2 * h * 8 * d  # q, then k and v of 8 key/value heads: 50,331,648
    o = 2 * 32 * d * h                        # 33,554,432
    core = 4 * s * 32 * d                     # the whole s x s square
    router = 2 * h * 8                        # 65,536
    experts = 2 * (3 * 2 * h * 14336)         # top-2 of the 8 SwiGLU experts: 704,643,072
    assert flops.block_forward(spec) == flops.BlockFlops(qkv=qkv, out=o, core=core, mlp=router + experts)
    head = 2 * h * 32000
    assert flops.forward_per_token(spec) == 32 * (qkv + o + core + router + experts) + head
    # against 6·(active parameters) + 12·L·h·s: Mixtral's 12.9B active of 46.7B (tests/test_planner_moe.py),
    # less the untied input embedding and the norms, no GEMM's
    total = 46_702_792_704
    n_active = active_params(spec, total)
    assert round(n_active / 1e9, 1) == 12.9
    assert flops.model_flops_per_token(spec) == 6 * (n_active - 32000 * h - (2 * 32 + 1) * h) + 12 * 32 * h * s


# -- the conventions ------------------------------------------------------------------------------------------

def test_causal_counts_half_the_square_and_nothing_else():
    for spec in (LLAMA3_405B, MIXTRAL, GPTS[0]):
        full, causal = flops.block_forward(spec), flops.block_forward(spec, "causal")
        assert causal.core == full.core / 2 and causal.weight_gemms == full.weight_gemms
        assert (flops.model_flops_per_step(spec, 4, "full") - flops.model_flops_per_step(spec, 4, "causal")
                == 3 * 4 * spec.seq_len * spec.layers * full.core / 2)


def test_tied_or_untied_the_head_counts_and_the_embedding_does_not():
    gpt = GPTS[0]
    assert flops.forward_per_token(gpt) == flops.forward_per_token(gpt.replace(tie_embeddings=False))
    assert flops.layer_forward(gpt, "embedding") == 0 and flops.layer_forward(gpt, "head") == 2 * gpt.hidden * gpt.vocab


def test_grouped_query_attention_narrows_k_and_v_only():
    mha = LLAMA3_405B.replace(kv_heads=None)
    gqa, full = flops.block_forward(LLAMA3_405B), flops.block_forward(mha)
    assert full.qkv == 3 * 2 * 16384 * 16384 and gqa.qkv == full.qkv - 2 * 2 * 16384 * (16384 - 1024)
    assert (gqa.out, gqa.core, gqa.mlp) == (full.out, full.core, full.mlp)


def test_swiglu_has_three_matrices_gelu_two():
    gelu = LLAMA3_405B.replace(activation="gelu")
    assert flops.block_forward(LLAMA3_405B).mlp == 3 * 2 * 16384 * 53248
    assert flops.block_forward(gelu).mlp == 2 * 2 * 16384 * 53248


def test_shared_experts_count_and_held_experts_do_not():
    deepseek = load_spec("model_specs/llama.py:debug-deepseek")
    m, h = deepseek.moe, deepseek.hidden
    assert m.shared_experts == 1 and m.top_k == 4
    assert flops.block_forward(deepseek).mlp == 2 * h * (m.num_experts + 3 * (4 * m.ffn + m.shared_ffn))
    more = deepseek.replace(moe_num_experts=32)  # more experts held: only the router grows
    assert flops.block_forward(more).mlp - flops.block_forward(deepseek).mlp == 2 * h * 16


def test_the_layers_sum_to_the_model_and_the_partition_weighs_them():
    for spec in (LLAMA3_405B, MIXTRAL, GPTS[1]):
        kinds = layer_kinds(spec)
        assert sum(flops.layer_flops_per_token(spec, k) for k in kinds) == flops.model_flops_per_token(spec)
        infos = layer_infos(spec, dict.fromkeys(flops.KINDS, 1))
        assert [i.flops for i in infos] == [flops.layer_flops_per_token(spec, k) for k in kinds]


def test_bad_arguments_name_what_is_valid():
    with pytest.raises(ValueError, match="attention='half' must be one of full, causal"):
        flops.block_forward(GPTS[0], "half")
    with pytest.raises(ValueError, match="recompute='all' must be one of none, selective, full"):
        flops.hardware_flops_per_step(GPTS[0], 1, "all")
    with pytest.raises(ValueError, match="kind='norm' must be one of embedding, block, head"):
        flops.layer_forward(GPTS[0], "norm")


# -- the planner's timed kernels do the work core/flops.py counts ---------------------------------------------

class CountingMachine(Machine):
    """A machine whose GEMMs and fused kernels take as many seconds as they do FLOPs (2·m·n·k a GEMM), and
    whose memory-bound kernels, host dispatch and communication take none: the planner's costs become the
    FLOPs it times."""

    def _gemm(self, m, n, k, batch, peak, elem):
        return 2.0 * m * n * k * batch

    def flops(self, flops, fraction):
        return flops

    def mem(self, nbytes, kernels=1):
        return 0.0

    def host(self, ops):
        return 0.0

    def ring(self, *args, **kwargs):
        return 0.0

    def all_to_all(self, *args, **kwargs):
        return 0.0


LLAMA_SMALL = ModelSpec(family="llama", layers=2, hidden=256, heads=8, kv_heads=2, ffn_hidden=688, vocab=1024,
                        seq_len=128, norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False,
                        bias=False)
TIMED = [(GPTS[1].replace(vocab=1536), 1), (LLAMA_SMALL, 1), (LLAMA_SMALL, 2),
         (LLAMA_SMALL.replace(attention_dropout=0.1), 2),
         (LLAMA_SMALL.replace(moe_num_experts=8, moe_top_k=2, moe_ffn=128), 1),
         (LLAMA_SMALL.replace(moe_num_experts=8, moe_top_k=2, moe_ffn=128, moe_shared_experts=1, moe_shared_ffn=64), 1)]


@pytest.mark.parametrize("impl", [MEGAZERO, MEGATRON_SC21], ids=["megazero", "megatron_sc21"])
@pytest.mark.parametrize("spec,tp", TIMED, ids=["gpt", "llama", "llama-tp2", "llama-dropout", "moe", "moe-shared"])
def test_the_planners_timed_gemms_are_core_flops(spec, tp, impl):
    """Per token and whole (x tp ranks): the block's weight GEMMs forward (fused qkv or not) are
    `BlockFlops.weight_gemms`, backward's input- and weight-gradient GEMMs twice that; the attention core
    is the causal half with flash attention (what the kernel runs) and the whole square when the scores
    are materialised (attention dropout); the head's GEMMs are 2·h·V forward (the vocabulary padded to a
    multiple of tp·vocab_align, as TIMED's vocabularies already are)."""
    layout = Layout(tp=tp, pp=1, dp=1, micro_batch=2, global_batch=2, zero=0)
    mc = CountingMachine(A100, DEFAULT_EFFICIENCY, layout)
    tokens = layout.micro_batch * spec.seq_len
    cost = block_cost(spec, layout, mc, impl)

    def per_token(rank_flops: float) -> float:  # one rank's FLOPs of a micro-batch -> the whole model's per token
        return rank_flops * tp / tokens

    want = flops.block_forward(spec, "full" if spec.attention_dropout else "causal")
    # rel 1e-12: the same products summed in another order (float64)
    assert per_token(cost.fwd["gemm"]) == pytest.approx(want.weight_gemms, rel=1e-12)
    assert per_token(cost.bwd["gemm"] + cost.wgrad["gemm"]) == pytest.approx(2 * want.weight_gemms, rel=1e-12)
    assert per_token(cost.fwd["attention"]) == pytest.approx(want.core, rel=1e-12)
    assert set(cost.fwd) - {"gemm", "attention"} <= {"elementwise", "tp_comm", "all_to_all"}
    assert spec.padded_vocab(tp) == spec.vocab
    _, _, head_f, head_b, head_w = embedding_head_cost(spec, layout, mc)
    assert per_token(head_f["embedding_head"]) == flops.head_forward(spec)
    assert per_token(head_b["embedding_head"] + head_w["embedding_head"]) == 2 * flops.head_forward(spec)


@pytest.mark.parametrize("method", ["ulysses", "ring"])
@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2), (4, 1)])
def test_the_planners_context_parallel_cores_are_core_flops(method, cp, tp):
    """With context parallelism each rank's weight GEMMs are over its s/cp tokens; Ulysses' SDPA does the
    causal half of the square on a/(t·cp) heads; the ring's plain-PyTorch chunk pairs (a GPU) compute the
    two diagonal pairs of each rank whole (the mask saves no work): 2·cp + 1 pairs where the causal half
    is 2·cp, of c x c = (s/(2·cp))² each."""
    layout = Layout(tp=tp, pp=1, dp=1, cp=cp, cp_method=method, micro_batch=2, global_batch=2, zero=0)
    mc = CountingMachine(A100, DEFAULT_EFFICIENCY, layout)
    cost = block_cost(LLAMA_SMALL, layout, mc, MEGAZERO)
    tokens = layout.micro_batch * LLAMA_SMALL.seq_len // cp
    want = flops.block_forward(LLAMA_SMALL, "causal")
    extra = 1.0 if method == "ulysses" else (2 * cp + 1) / (2 * cp)
    # rel 1e-12: the same products summed in another order (float64)
    assert cost.fwd["gemm"] * tp / tokens == pytest.approx(want.weight_gemms, rel=1e-12)
    assert cost.fwd["attention"] * tp / tokens == pytest.approx(extra * want.core, rel=1e-12)


# -- the trainer's MFU and the planner's read the same FLOPs --------------------------------------------------

SCALE = 1.5
"""Both sides run with `megazero.core.flops.forward_per_token` scaled by this: a side that counted its own
FLOPs would be 1/SCALE of the other."""
RUN = ["parallel.pp=1", "parallel.tp=1", "data.path=null", "train.steps=2", "log.interval=1",
       "train.global_batch_size=4", "log.progress_bar=false", "log.peak_tflops=1.0"]


def _scaled(monkeypatch_setattr):
    real = flops.forward_per_token
    monkeypatch_setattr(flops, "forward_per_token", lambda spec, attention="full": SCALE * real(spec, attention))


def _trainer_flops(run_dir: str) -> list[float]:
    """The FLOPs per step behind the MFU the trainer writes for each step of the debug run: mfu x step time x
    devices (1) x log.peak_tflops (1 TFLOP/s)."""
    from megazero.engine import load_run_config
    from megazero.run import train

    _scaled(setattr)  # this rank's own process
    metrics = f"{run_dir}/metrics.jsonl"
    cfg = load_run_config("configs/debug_llama.yaml", RUN + [f"run_dir={run_dir}", f"log.metrics_file={metrics}"])
    assert train.run(cfg, 0) == 0
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    return [r["mfu"] * r["step_time_s"] * 1 * 1.0e12 for r in rows]


def test_the_trainers_mfu_and_the_planners_read_the_same_flops(tmp_path, monkeypatch):
    from megazero.engine import load_run_config
    from megazero.planner.from_config import layout_of, spec_of

    (trainer,) = run_ranks(_trainer_flops, 1, str(tmp_path / "run"), timeout=240)
    cfg = load_run_config("configs/debug_llama.yaml", RUN + [f"run_dir={tmp_path / 'plan'}"])
    spec, (layout, why) = spec_of(cfg), layout_of(cfg)
    assert layout is not None, why
    real = flops.model_flops_per_step(spec, cfg.train.global_batch_size)
    _scaled(monkeypatch.setattr)
    count = flops.model_flops_per_step(spec, cfg.train.global_batch_size)
    assert count == pytest.approx(SCALE * real, rel=1e-12)  # float64 rounding of one product
    plan = predict_step(spec, layout, A100)
    planner = plan.model_tflops_per_gpu * plan.step_time_s * layout.gpus * 1e12
    assert spec.num_kv_heads < spec.heads and spec.activation == "swiglu"  # where the old counts disagreed
    assert len(trainer) == 2
    # rel 1e-9: each side divided the count by its step time (and devices, peak) and the test multiplied back
    assert all(t == pytest.approx(count, rel=1e-9) for t in trainer), (trainer, count)
    assert planner == pytest.approx(count, rel=1e-9)
    assert plan.mfu == pytest.approx(count / (plan.step_time_s * layout.gpus * Machine(A100, DEFAULT_EFFICIENCY,
                                                                                        layout).peak), rel=1e-9)

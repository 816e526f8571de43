"""Layout-invariant initialization: the same seed gives the same full model for every TP size and
pipeline layout, without any rank generating more than its shard plus one tile; meta construction.

Single process: constructing a layer does not communicate, so every rank of a TP group of t can be
built here with a GroupHandle that has no process group, and the shards compared bit for bit.
"""
import time

import pytest
import torch

from megazero.runtime.comm import CommStats, GroupHandle, single_rank_group
from megazero.models import CausalLM, layer_builders
from megazero.core.spec import load_spec
from megazero.tensor_parallel import init as tp_init
from megazero.tensor_parallel import counts_once_in_norm, make_param, unique_params
from tests.test_spec import SPECS


def fake_tp_group(t, r):
    """A TP group handle for building rank r's shards of a group of t (no communication)."""
    return GroupHandle("tp", tuple(range(t)), r, None, CommStats())


def assemble(shard_lists):
    """{logical_name: full tensor} from each rank's parameters, concatenating along tp_dim."""
    by_name = {}
    for params in shard_lists:
        for p in params:
            by_name.setdefault(p.logical_name, []).append(p)
    out = {}
    for name, ps in by_name.items():
        p = ps[0]
        if p.tp_dim is None:
            assert all(torch.equal(q, p) for q in ps), f"{name} differs across TP ranks"
            out[name] = p.detach()
        else:
            full = torch.cat([q.detach() for q in ps], dim=p.tp_dim)
            pad = full.narrow(p.tp_dim, p.full_shape[p.tp_dim], full.shape[p.tp_dim] - p.full_shape[p.tp_dim])
            assert not pad.any(), f"{name}: padding rows are not zero"
            out[name] = full.narrow(p.tp_dim, 0, p.full_shape[p.tp_dim])
    return out


def full_model(spec, t, seed=11):
    return assemble([unique_params(CausalLM(spec, fake_tp_group(t, r), seed=seed)) for r in range(t)])


@pytest.mark.parametrize("flavor", ["gpt.py:debug", "llama.py:debug"])
def test_same_seed_same_full_model_for_every_tp(flavor):
    spec = load_spec(SPECS + flavor, {"vocab": 1001, "vocab_align": 1})
    ref = full_model(spec, 1)
    for t in (2, 4):
        got = full_model(spec, t)
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"tp={t}: {k} differs"
    other_seed = full_model(spec, 1, seed=12)
    assert not torch.equal(other_seed["layers.0.attn.q.weight"], ref["layers.0.attn.q.weight"])


def test_pipeline_stage_builds_only_its_layers_with_the_same_values():
    spec = load_spec(SPECS + "gpt.py:debug", {"layers": 4})
    whole = {p.logical_name: p for p in unique_params(CausalLM(spec, single_rank_group("tp"), seed=3))}
    builders = layer_builders(spec, single_rank_group("tp"), seed=3)
    assert [b.name for b in builders] == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    stage = [builders[3](None), builders[4](None), builders[5](None)]  # last stage of pp=2: blocks 2, 3 and head
    names = [p.logical_name for p in unique_params(stage)]
    assert names[0] == "layers.2.attn_norm.weight" and "layers.3.mlp.fc2.weight" in names
    head_w = stage[-1].weight
    assert head_w.logical_name == "embedding.word.weight" and head_w.tied_name == "embedding.word"
    for p in unique_params(stage):  # includes the head's own copy of the tied embedding
        assert torch.equal(p, whole[p.logical_name]), p.logical_name


def test_multi_tile_parameters_are_layout_invariant(monkeypatch):
    monkeypatch.setattr(tp_init, "TILE_2D", (5, 7))  # force many tiles, some straddling shard edges
    monkeypatch.setattr(tp_init, "TILE_1D", (3,))
    for shape, tp_dim in [((24, 22), 0), ((22, 24), 1), ((26,), 0), ((23, 10), 0)]:
        def shards(t):
            local = list(shape)
            local[tp_dim] = -(-shape[tp_dim] // t)
            return [make_param(local, logical_name="w", full_shape=shape, tp_dim=tp_dim, tp_rank=r, tp_size=t,
                               init="normal", seed=1) for r in range(t)]
        ref = assemble([shards(1)])["w"]
        for t in (2, 4):
            assert torch.equal(assemble([[p] for p in shards(t)])["w"], ref), (shape, t)


def test_a_rank_generates_only_tiles_overlapping_its_shard():
    # A 12288 x 49152 row-parallel weight (GPT-3 fc2) split 8 ways along dim 1: each rank owns 6144
    # columns, so it draws 12 row-tiles x 6 column-tiles, never the other ranks' columns.
    full, t = (12288, 49152), 8
    start, stop = tp_init.shard_range(full[1], full[1], 3, t)
    tiles = tp_init.tiles_for_shard(full, 1, start, stop)
    assert len(tiles) == 12 * 6 and {j for _, j in tiles} == set(range(18, 24))
    assert tp_init.TILE_2D[0] * tp_init.TILE_2D[1] * 4 <= 4 << 20  # one tile: at most 4 MiB of fp32
    # a padded vocabulary shard that holds only padding draws nothing
    assert tp_init.tiles_for_shard((1001, 64), 0, 1004, 1255) == []


def test_init_statistics_and_metadata():
    p = make_param((4096, 64), logical_name="x.weight", full_shape=(8192, 64), tp_dim=0, tp_rank=1, tp_size=2,
                   init="normal", seed=0, std=0.02)
    # 262,144 N(0, 0.02) samples: the std and the mean have a standard error of ~3e-5 and ~4e-5, so 5e-4 is > 10 of them
    assert abs(p.std().item() - 0.02) < 5e-4 and abs(p.mean().item()) < 5e-4
    assert (p.logical_name, p.full_shape, p.tp_dim, p.tp_rank, p.tp_size) == ("x.weight", (8192, 64), 0, 1, 2)
    with pytest.raises(ValueError, match="unknown init 'uniform'"):
        make_param((2,), logical_name="b", full_shape=(2,), tp_dim=None, tp_rank=0, tp_size=1, init="uniform", seed=0)


def test_metadata_marks_split_replicated_and_sequence_parallel_params():
    spec = load_spec(SPECS + "gpt.py:debug")
    model = CausalLM(spec, fake_tp_group(2, 0), sequence_parallel=True)
    params = {p.logical_name: p for p in unique_params(model)}
    assert params["layers.0.attn.q.weight"].tp_dim == 0 and params["layers.0.attn.out.weight"].tp_dim == 1
    assert params["layers.0.mlp.fc1.bias"].tp_dim == 0
    for name in ("layers.0.attn.out.bias", "layers.1.mlp_norm.weight", "embedding.position.weight", "head.norm.bias"):
        assert params[name].tp_dim is None and params[name].sequence_parallel, name
    assert not params["layers.0.attn.q.weight"].sequence_parallel
    assert model.head.weight is model.embedding.word.weight  # tied at pp=1
    assert counts_once_in_norm(params["layers.0.attn.q.weight"], tp_rank=1)
    assert not counts_once_in_norm(params["layers.0.attn.out.bias"], tp_rank=1)
    assert counts_once_in_norm(params["layers.0.attn.out.bias"], tp_rank=0)
    untied = CausalLM(load_spec(SPECS + "llama.py:debug"), fake_tp_group(2, 1))
    for name, p in untied.named_parameters():  # at pp=1 module names are the logical names
        assert name == p.logical_name
    assert untied.head.weight.logical_name == "head.weight" and not hasattr(untied.head.weight, "tied_name")


def test_meta_device_construction_counts_a_175b_model_quickly():
    spec = load_spec(SPECS + "gpt.py:gpt3-175b")
    t0 = time.perf_counter()
    model = CausalLM(spec, fake_tp_group(8, 0), device="meta")
    n = model.num_params()
    assert time.perf_counter() - t0 < 20
    assert all(p.device.type == "meta" for p in model.parameters())
    l, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    # Megatron-LM's count 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), plus the final LayerNorm (2h)
    assert n == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h
    assert abs(n / 1e9 - 174.6) < 0.1

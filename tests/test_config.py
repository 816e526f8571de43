"""megazero.core.config: loading, overrides, the batch rule, resolve, not-supported-yet, bubble, explain CLI."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megazero.core.config import (NOT_SUPPORTED, Config, ConfigError, ModelConfig, Unsupported, all_keys,
                             assert_supported, derive_batch, get_key, load_config, resolve,
                             derived_values, to_yaml, unsupported, validate)
from megazero.core.config.__main__ import main
from megazero.core.instructions import ScheduleError
from megazero.core.schedules import bubble_fraction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "configs", "debug_gpt.yaml")
CONFIGS = os.path.join(REPO, "tests", "configs")


def test_debug_example_resolves_on_8_ranks():
    cfg = load_config(DEBUG, world_size=8)
    assert isinstance(cfg, Config) and isinstance(cfg.model, ModelConfig)
    assert (cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp) == (2, 2, 2)
    t = cfg.train
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (2, 4, 16)
    assert cfg.name == "debug_gpt" and cfg.run_dir == "runs/debug_gpt"
    assert cfg.checkpoint.dir == "runs/debug_gpt/checkpoints"
    assert cfg.log.metrics_file == "runs/debug_gpt/metrics.jsonl"
    assert cfg.scheduler.total_steps == cfg.train.steps == 20
    assert cfg.optimizer.adamw_mode is True
    assert_supported(cfg)


def test_defaults_are_valid_and_supported():
    cfg = load_config(None, world_size=1)
    assert cfg.parallel.dp == 1 and cfg.train.global_batch_size == 1
    assert cfg.name == "run" and cfg.run_dir == "runs/run"
    assert_supported(cfg)
    assert unsupported(Config()) == []


def test_unresolved_without_world_size():
    cfg = load_config(DEBUG)
    assert cfg.parallel.dp is None and cfg.train.gradient_accumulation_steps is None
    assert cfg.train.global_batch_size == 16  # the file's value, not derived yet
    assert load_config(DEBUG, ["parallel.dp=1"]).train.gradient_accumulation_steps == 8  # 16 = 2 x 8 x dp 1


def test_model_dotlist_overrides():
    cfg = load_config(DEBUG, ["model.layers=6", "model.vocab=1001", "model.hidden=128",
                              "model.overrides.rope_theta=10000.0", "model.overrides.norm=rmsnorm"], world_size=8)
    assert (cfg.model.layers, cfg.model.vocab, cfg.model.hidden) == (6, 1001, 128)
    arch = cfg.model.architecture()
    assert arch == {"seq_len": 64, "layers": 6, "hidden": 128, "heads": 4, "vocab": 1001,
                    "rope_theta": 10000.0, "norm": "rmsnorm"}
    assert "spec" not in arch


def test_overrides_beat_file_and_lists_replace():
    cfg = load_config(DEBUG, ["train.steps=7", "parallel.order=[dp,pp,tp]", "optimizer.betas=[0.8,0.9]",
                              "name=other"], world_size=8)
    assert cfg.train.steps == 7 and cfg.parallel.order == ["dp", "pp", "tp"]
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.run_dir == "runs/other"
    assert cfg.optimizer.lr == 1e-3  # untouched file value


def test_yaml_numbers_and_nulls(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text("optimizer:\n  lr: 1e-3\nzero:\n  reduce_bucket_size: 5e8\ncheckpoint:\n  load: null\n")
    cfg = load_config(str(path), world_size=1)
    assert cfg.optimizer.lr == 1e-3 and cfg.zero.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero.reduce_bucket_size, int) and cfg.checkpoint.load is None
    assert cfg.name == "n"  # the file's stem


def test_megazero_json():
    cfg = load_config(os.path.join(CONFIGS, "mz_small.json"), world_size=4)
    assert cfg.parallel.dp == 2 and cfg.train.micro_batch_size == 2
    assert cfg.optimizer.type == "adam" and cfg.optimizer.adamw_mode is False


def test_yaml_round_trip_of_resolved_config(tmp_path):
    cfg = load_config(DEBUG, ["model.overrides.rope_theta=5.0", "pipeline.partition=[1,3]"], world_size=8)
    path = tmp_path / "again.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path), world_size=8) == cfg
    assert resolve(cfg, 8) == cfg  # idempotent


def test_resolve_derives_zero_auto_sizes():
    cfg = load_config(None, ["zero.reduce_bucket_size=null", "zero.prefetch_bucket_size=null",
                             "zero.param_persistence_threshold=null", "model.hidden=1024"], world_size=2)
    assert cfg.zero.reduce_bucket_size == 1024 * 1024
    assert cfg.zero.prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert cfg.zero.param_persistence_threshold == 10240
    assert cfg.zero.allgather_bucket_size == 500_000_000  # not auto: untouched
    assert load_config(None, ["zero.reduce_bucket_size=null"], world_size=1).zero.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize("stage,expected", [(0, False), (2, False), (3, True)])
def test_overlap_comm_default_follows_deepspeed(stage, expected):
    assert load_config(None, [f"zero.stage={stage}"], world_size=2).zero.overlap_comm is expected


@pytest.mark.parametrize("given_,dp,expected", [
    ((2, 4, None), 8, (2, 4, 64)),
    ((2, None, 64), 8, (2, 4, 64)),
    ((None, 4, 64), 8, (2, 4, 64)),
    ((None, None, 64), 8, (8, 1, 64)),
    ((3, None, None), 4, (3, 1, 12)),
    ((None, 5, None), 2, (1, 5, 10)),
    ((None, None, None), 3, (1, 1, 3)),
    ((2, 4, 64), 8, (2, 4, 64)),
])
def test_derive_batch_table(given_, dp, expected):
    assert derive_batch(*given_, dp) == expected


def test_batch_rule_uses_dp_not_world_size():
    cfg = load_config(None, ["parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2",
                             "train.gradient_accumulation_steps=4"], world_size=8)
    assert cfg.parallel.dp == 2 and cfg.train.global_batch_size == 16  # not 2*4*8


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 16), g=st.integers(1, 16), dp=st.integers(1, 64),
       mask=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_derive_batch_property(b, g, dp, mask):
    """Any subset of a consistent triple derives a triple that obeys the rule and keeps what was given."""
    full = (b, g, b * g * dp)
    given_ = tuple(v if keep else None for v, keep in zip(full, mask, strict=True))
    out = derive_batch(*given_, dp)
    assert out[0] * out[1] * dp == out[2]
    assert all(v is None or v == o for v, o in zip(given_, out, strict=True))
    if sum(mask) >= 2:
        assert out == full


@settings(max_examples=40, deadline=None)
@given(pp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 8))
def test_layout_property(pp, tp, dp):
    world = pp * tp * dp
    cfg = load_config(None, [f"parallel.pp={pp}", f"parallel.tp={tp}"], world_size=world)
    assert cfg.parallel.dp == dp
    with pytest.raises(ConfigError, match="world size"):
        load_config(None, [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.dp={dp + 1}"], world_size=world)


def test_validate_accepts_resolved_and_rejects_non_config():
    cfg = load_config(DEBUG, world_size=8)
    validate(cfg, 8)
    with pytest.raises(ConfigError, match="Config dataclass"):
        validate({"train": {}}, 8)
    with pytest.raises(ConfigError, match="parallel.dp: unknown"):
        resolve(Config())


def test_not_supported_table_is_well_formed():
    keys = set(all_keys())
    for entry in NOT_SUPPORTED:
        assert entry.key in keys, entry.key
        assert not entry.active(get_key(Config(), entry.key)), f"{entry.key} flags its own default"
        assert not entry.active(get_key(resolve(Config(), 1), entry.key)), entry.key


def test_assert_supported_lists_every_key_and_table_is_editable():
    cfg = load_config(None, ["zero.sub_group_size=100", "zero.max_live_parameters=5", "data.tokenizer=bpe"],
                      world_size=2)
    with pytest.raises(ConfigError) as info:
        assert_supported(cfg)
    keys = [line.split(":")[0] for line in str(info.value).splitlines()]
    assert {"zero.sub_group_size", "zero.max_live_parameters", "data.tokenizer"} <= set(keys)
    table = tuple(e for e in NOT_SUPPORTED if not e.key.startswith(("zero.", "data")))
    assert_supported(cfg, table)  # the lead removes lines as features land
    custom = (Unsupported("train.seed", lambda v: v == 7, "seed seven"),)
    with pytest.raises(ConfigError, match=r"^train.seed: not supported yet \(seed seven"):
        assert_supported(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=7)), custom)


@pytest.mark.parametrize("schedule,p,m,v,expected", [
    ("gpipe", 4, 8, 1, 3 / 11),
    ("1f1b", 4, 8, 1, 3 / 11),
    ("interleaved", 4, 8, 2, 3 / 19),
    ("zb-h1", 4, 8, 1, 3 / 27),
    ("1f1b", 1, 8, 1, 0.0),
    ("1f1b", 8, 1, 1, 7 / 8),
])
def test_bubble_fraction_values(schedule, p, m, v, expected):
    """The simulated bubble `explain` prints reaches the closed forms of docs/reference.md."""
    # float64 simulation of the schedule against the closed form: a few ulps
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), extra=st.integers(0, 9), k=st.integers(1, 4), v=st.integers(2, 3))
def test_bubble_fraction_is_the_closed_form_when_m_is_at_least_p(p, extra, k, v):
    m = p + extra
    # float64 simulation of the schedule against the closed form: a few ulps
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert bubble_fraction("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12)
    assert bubble_fraction("1f1b", p, m + 1) <= bubble_fraction("1f1b", p, m)  # more micro-batches, less idle
    m = k * p  # interleaving needs a multiple of p
    # float64 simulation of the schedule against the closed form: a few ulps
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


def test_bubble_fraction_rejects_unknown_schedule_and_sizes():
    with pytest.raises(ScheduleError, match="cannot read pipeline schedule file 'custom.csv'"):
        bubble_fraction("custom.csv", 2, 4)
    with pytest.raises(ScheduleError, match="num_microbatches=0 must be an integer >= 1"):
        bubble_fraction("1f1b", 2, 0)
    with pytest.raises(ConfigError, match="pipeline.schedule"):  # explain names the key
        derived_values(load_config(None, ["pipeline.schedule=missing.csv", "parallel.pp=2"], world_size=2))


def test_import_does_not_pull_torch():
    code = "import sys, megazero.core.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_explain_cli_subprocess():
    out = subprocess.run([sys.executable, "-m", "megazero.core.config", "explain", DEBUG, "model.layers=6",
                          "--world-size", "8"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "layers: 6" in out.stdout and "global_batch_size: 16" in out.stdout
    assert "dp_size: 2" in out.stdout and "micro_batches_per_flush: 4" in out.stdout
    assert "bubble_fraction: 0.2" in out.stdout  # (2-1)/(4+2-1)


def test_explain_cli_in_process(capsys):
    assert main(["explain", DEBUG, "pipeline.schedule=interleaved", "pipeline.chunks=2", "zero.stage=1",
                 "zero.sub_group_size=100", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble_fraction: 0.111111" in out  # (2-1)/(2*4+2-1)
    assert "# not supported yet" in out and "zero.sub_group_size: not supported yet" in out
    assert "zero.stage: not supported yet" not in out
    assert main(["explain", DEBUG, "train.stepz=3", "--world-size", "8"]) == 2
    assert "train.stepz" in capsys.readouterr().err
    assert main(["explain", "none", "parallel.dp=2"]) == 0  # world = pp*tp*dp
    assert "world_size: 2" in capsys.readouterr().out

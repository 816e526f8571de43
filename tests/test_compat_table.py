"""The README's table of DeepSpeed's API ("DeepSpeed's API, name by name") cannot drift: every name it
lists resolves under megazero at DeepSpeed's path, every test it names exists and mentions the name,
every "refused" name's test checks a refusal, and every name issue 32 asked for is in the table."""
import pathlib
import re

import pytest

import megazero

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# DeepSpeed's documented API that the compatibility layer answers for (namespaces of its API reference and
# tutorials); each must be a row of the table
REQUIRED = [
    "initialize", "add_config_arguments", "init_distributed", "engine.is_gradient_accumulation_boundary",
    "engine.set_gradient_accumulation_boundary", "engine.fp16_enabled", "engine.bfloat16_enabled",
    "engine.zero_optimization_stage", "engine.global_rank", "engine.world_size", "engine.dp_world_size",
    "engine.mp_world_size", "engine.global_steps", "engine.global_samples", "engine.module", "engine.optimizer",
    "engine.lr_scheduler", "engine.monitor", "engine.grid", "accelerator.get_accelerator",
    "comm.log_summary", "config comms_logger", "zero.Init", "zero.GatheredParameters",
    "zero.register_external_parameter", "zero.TiledLinear",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold",
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold",
    "utils.safe_get_full_fp32_param", "utils.safe_get_full_grad", "utils.safe_get_full_optimizer_state",
    "utils.safe_get_local_fp32_param", "utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "utils.log_dist", "utils.logger", "utils.RepeatingLoader", "checkpointing.configure", "checkpointing.checkpoint",
    "checkpointing.get_cuda_rng_tracker", "checkpointing.model_parallel_cuda_manual_seed", "pipe.PipelineModule",
    "pipe.LayerSpec", "pipe.TiedLayerSpec", "runtime.pipe.topology.ProcessTopology",
    "runtime.pipe.topology.PipeModelDataParallelTopology", "runtime.utils.set_random_seed", "ops.adam.FusedAdam",
    "ops.adam.DeepSpeedCPUAdam", "ops.lamb.FusedLamb", "config tensorboard", "config csv_monitor", "config wandb",
    "config flops_profiler", "config wall_clock_breakdown", "config memory_breakdown", "moe.layer.MoE",
    "moe.utils.split_params_into_different_moe_groups_for_optimizer", "moe.utils.is_moe_param",
]


NAMESPACES = ("engine", "accelerator", "comm", "zero", "utils", "checkpointing", "pipe", "runtime", "ops", "profiling",
              "moe")


def rows():
    """(names, status, test paths) of each table row. A name without a namespace continues the first
    name of its cell (`utils.safe_get_full_grad`, `safe_get_local_grad`); in a row starting with
    "config", each name is a DeepSpeed config section."""
    section = README.split("### DeepSpeed's API, name by name", 1)[1]
    table = section[section.index("| DeepSpeed name"):].split("\n\n", 1)[0]  # the table: up to the blank line
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 3 or cells[0] == "DeepSpeed name":
            continue
        tokens = [t for t in re.findall(r"`([^`]+)`", cells[0]) if not t.endswith(".py")]
        if cells[0].startswith("config "):
            names = ["config " + t for t in tokens]
        else:
            prefix = tokens[0].rsplit(".", 1)[0] + "." if "." in tokens[0] else ""
            names = [t if t == tokens[0] or t.split(".")[0] in NAMESPACES else prefix + t for t in tokens]
        out.append((names, cells[1], re.findall(r"`(tests/[^`]+\.py)`", cells[2])))
    return out


ROWS = rows()
NAMES = [n for names, _, _ in ROWS for n in names]


def _resolve(name: str):
    """The object `name` denotes under megazero (config keys: the DeepSpeed key rule)."""
    if name.startswith("config "):
        from megazero.core.config import deepspeed_keys

        key = name.split(" ", 1)[1]
        assert any(r.ds == key or r.ds.startswith(key + ".") for r in deepspeed_keys.RULES), key
        return key
    if name.startswith("engine."):
        from megazero.engine import ModuleEngine, PipelineEngine

        attr = name.split(".", 1)[1]
        instance_attrs = {"module", "optimizer", "lr_scheduler", "local_rank", "device", "global_steps", "monitor"}
        import inspect

        def has(cls):  # a method or property, or an attribute its constructor sets
            return hasattr(cls, attr) or attr in instance_attrs and attr in re.findall(
                r"self\.(\w+)", inspect.getsource(cls.__init__))

        # as in DeepSpeed, a pipeline engine trains through train_batch only (no backward / step)
        assert has(ModuleEngine) or has(PipelineEngine), attr
        return attr
    obj = megazero
    for part in re.split(r"\.(?![^(]*\))", name):
        if part.endswith("()"):
            obj = getattr(obj, part[:-2])()
        else:
            obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", NAMES)
def test_every_listed_name_resolves(name):
    _resolve(name)


@pytest.mark.parametrize("names, status, tests", ROWS, ids=[r[0][0] for r in ROWS])
def test_each_row_names_a_test_that_exercises_it(names, status, tests):
    """Every name of a row is mentioned by one of the tests the row names (as a call, an attribute or a
    config key: its last dotted part), and a refusal's test checks for the refusal."""
    assert status.split(":")[0].split(" ")[0].rstrip(";,") in ("same", "differs", "refused"), status
    assert tests and all((ROOT / t).is_file() for t in tests), (names, tests)
    text = "".join((ROOT / t).read_text() for t in tests)
    for name in names:
        leaf = re.split(r"[. ]", name.replace("()", ""))[-1]
        assert leaf in text, f"{tests} do not mention {leaf} ({name}, listed as {status!r})"
    if status.startswith("refused"):
        assert "NotImplementedError" in text or "not supported yet" in text, tests


def test_every_required_name_is_in_the_table():
    missing = [n for n in REQUIRED if n not in NAMES]
    assert missing == [], missing


def test_the_gradient_semantics_table_names_real_tests():
    """The second table (PyTorch's gradient semantics at the engine's edge): each row's test function exists."""
    section = README.split("| PyTorch's gradient semantics", 1)[1].split("\n\n", 1)[0]
    found = re.findall(r"`(tests/[^`:]+\.py)::(\w+)`", section)
    assert len(found) >= 10
    for path, func in found:
        assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), (path, func)

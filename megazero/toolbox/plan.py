"""``python tools/plan.py SPEC[:flavor] [key=value ...] --hardware NAME --gpus N --global-batch B ...``

What a layout will cost before launch: memory per GPU for every pipeline stage (the tightest named)
and the step time with its breakdown, from `megazero.planner` (memory_plan.py, speed.py) and the
parameters of the model built on the meta device (`megazero.toolbox.model_facts`). ``--search`` ranks
every layout that fits the GPUs and the batch by predicted throughput and says why each other one
does not fit; ``--json`` prints one object instead of text.

SPEC is a spec file and flavor (``model_specs/gpt.py:gpt3-175b``) or, for the files in model_specs/,
just ``gpt:gpt3-175b``; key=value pairs override spec fields (a generic GPT or Llama:
``gpt:debug layers=96 hidden=12288 heads=96 vocab=51200 seq_len=2048``). Exit status: 0, 1 when the
layout does not fit (or nothing fits), 2 for bad input (one line on stderr naming the argument).

``python tools/plan.py --calibrate OUT.yaml [--ranks N]`` measures this machine instead (GEMMs, memory
bandwidth, collectives over N ranks; `megazero.toolbox.calibrate`) and writes the hardware file to plan with.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from functools import lru_cache

from megazero.core.spec import SpecError, load_spec
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout, PlanError
from megazero.planner.memory_plan import GB, predict_memory
from megazero.planner.moe_plan import active_params
from megazero.planner.search import CHUNKS, candidates
from megazero.planner.speed import estimate_step_time, predict_step
from megazero.toolbox.model_facts import model_facts

SCHEDULE_HELP = ("1f1b | gpipe | interleaved[:V] (V chunks per stage; without V the planner tries V = "
                 "2, 3, 4, 6, 8 where the layers allow and keeps the fastest that fits) | zb-h1")
PARTITION_HELP = ("pipeline.partition: uniform (default) | parameters | flops | type:REGEX | N,N,... (transformer "
                  "blocks per virtual stage; the embedding joins the first, the head the last)")


def spec_ref(ref: str, spec_dir: str) -> str:
    """`ref` as load_spec takes it: a path, or ``NAME:flavor`` for ``spec_dir/NAME.py``."""
    where, sep, flavor = ref.partition(":")
    if os.sep not in where and "/" not in where and not where.endswith(".py"):
        where = os.path.join(spec_dir, where + ".py")
    return where + sep + flavor


def parse_schedule(text: str) -> tuple[str, int | None]:
    """(schedule, chunks): chunks None for ``interleaved`` without ``:V`` (the planner chooses)."""
    name, _, v = text.partition(":")
    if name == "interleaved":
        try:
            chunks = int(v) if v else None
        except ValueError:
            raise PlanError(f"--schedule {text!r}: the chunks after 'interleaved:' must be an integer") from None
        return name, chunks
    if v:
        raise PlanError(f"--schedule {text!r}: only interleaved takes ':V'")
    return name, 1


def parse_partition(text: str) -> str | tuple[int, ...]:
    """``--partition``: a method name as is, ``N,N,...`` as a tuple of block counts."""
    if text and (text[0].isdigit() or "," in text):
        try:
            return tuple(int(n) for n in text.split(","))
        except ValueError:
            raise PlanError(f"--partition {text!r}: a list is comma-separated transformer-block counts, e.g. "
                            f"7,8,8,7") from None
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/plan.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="SPEC[:flavor], e.g. gpt:gpt3-175b or model_specs/llama.py:llama3-405b")
    p.add_argument("overrides", nargs="*", help="spec fields as key=value, e.g. layers=48 seq_len=4096")
    p.add_argument("--hardware", required=True, help="a preset of configs/hardware/ (file stem) or a YAML path")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int, help="default: gpus / (tp x pp x cp)")
    p.add_argument("--cp", type=int, help="context parallel: ranks per sequence (parallel.cp; default 1; searched "
                                          "from 16K tokens)")
    p.add_argument("--cp-method", choices=("ring", "ulysses"), help="parallel.cp_method (default ring)")
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--ep", type=int, help="MoE: expert-parallel ranks, carved out of dp (default 1; searched)")
    p.add_argument("--expert-tp", type=int, help="MoE: 1 (whole experts on every TP rank) or tp (default: tp)")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="MoE: the busiest expert-parallel rank's routed rows over the balanced share (default 1.0)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--recompute", choices=("none", "selective", "full"))
    p.add_argument("--schedule", help=SCHEDULE_HELP)
    p.add_argument("--partition", help=PARTITION_HELP)
    p.add_argument("--sequence-parallel", action="store_true", default=None)
    p.add_argument("--offload-optimizer", action="store_true", default=None)
    p.add_argument("--offload-param", action="store_true", default=None)
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--hierarchical", action="store_true", default=None,
                   help="comm.hierarchical: data-parallel reductions and gathers inside each node, then between nodes")
    p.add_argument("--ranks-per-node", type=int, help="parallel.ranks_per_node (default: the hardware's gpus_per_node)")
    p.add_argument("--onebit", action="store_true", default=None,
                   help="1-bit Adam (optimizer.type=onebit_adam) past its warm-up; needs --zero 0")
    p.add_argument("--qwz", action="store_true", default=None, help="ZeRO++ zero.quantized_weights (int8 gathers; zero 3)")
    p.add_argument("--hpz", type=int, help="ZeRO++ zero.hpz_partition_size K (secondary partition over K dp ranks; zero 3)")
    p.add_argument("--qgz", action="store_true", default=None,
                   help="ZeRO++ zero.quantized_gradients (int8 reduce-scatter by all-to-all; zero 3)")
    p.add_argument("--search", action="store_true", help="rank every layout that fits (the given flags are held)")
    p.add_argument("--top", type=int, default=10, help="layouts shown by --search (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def fixed_choices(args) -> dict:
    """The Layout fields the command line sets."""
    fixed = {}
    for arg, field in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("cp_method", "cp_method"),
                       ("ep", "ep"), ("expert_tp", "expert_tp"),
                       ("micro_batch", "micro_batch"), ("zero", "zero"),
                       ("recompute", "recompute"), ("sequence_parallel", "sequence_parallel"),
                       ("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param"),
                       ("hierarchical", "hierarchical"), ("ranks_per_node", "ranks_per_node"), ("onebit", "onebit"),
                       ("qwz", "quantized_weights"), ("hpz", "hpz"), ("qgz", "quantized_gradients")):
        if getattr(args, arg) is not None:
            fixed[field] = getattr(args, arg)
    if args.schedule is not None:
        fixed["schedule"], chunks = parse_schedule(args.schedule)
        if chunks is not None:
            fixed["chunks"] = chunks
    if args.partition is not None:
        fixed["partition"] = parse_partition(args.partition)
    if args.moe_imbalance != 1.0:
        fixed["moe_imbalance"] = args.moe_imbalance
    return fixed


def one_layout(args, fixed: dict) -> Layout:
    """The layout the flags describe (unset ones at their defaults), dp = gpus / (tp x pp x cp)."""
    tp, pp, cp = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("cp", 1)
    if args.gpus % (tp * pp * cp):
        raise PlanError(f"--gpus {args.gpus} is not divisible by tp x pp = {tp} x {pp}" if cp == 1 else
                        f"--gpus {args.gpus} is not divisible by tp x pp x cp = {tp} x {pp} x {cp}")
    dp = args.gpus // (tp * pp * cp)
    if fixed.get("dp", dp) != dp:
        raise PlanError(f"--dp {fixed['dp']}: tp x pp x cp x dp must be --gpus {args.gpus}; with tp={tp}, pp={pp}, "
                        f"cp={cp} dp is {dp}")
    given = {k: v for k, v in fixed.items() if k not in ("tp", "pp", "dp", "cp")}
    return Layout(tp=tp, pp=pp, dp=dp, cp=cp, global_batch=args.global_batch, precision=args.precision,
                  **{"micro_batch": 1, **given})


class Planner:
    """Plans layouts of one model on one hardware; the meta-device facts are built once per (tp, pp, chunks,
    partition, sequence parallelism)."""

    def __init__(self, spec, hardware):
        self.spec, self.hardware = spec, hardware
        self._facts = lru_cache(maxsize=None)(self._build_facts)
        self.schedules: dict = {}  # pipeline programs by (schedule, p, m, v, costs), shared by every plan

    def _build_facts(self, tp: int, pp: int, chunks: int, partition, sp: bool):
        return model_facts(self.spec, tp, pp, chunks, partition=partition, sequence_parallel=sp)

    def facts(self, layout: Layout):
        """The meta-device `ModelFacts` of the layout's tp x pp x chunks and partition."""
        partition = layout.partition if isinstance(layout.partition, str) else tuple(layout.partition)
        return self._facts(layout.tp, layout.pp, layout.chunks, partition, layout.sequence_parallel)

    def memory(self, layout: Layout):
        """The `MemoryPlan` of one layout (a search drops the layouts that do not fit before timing them)."""
        layout.check(self.spec)
        return predict_memory(self.spec, layout, self.facts(layout), self.hardware, schedule_cache=self.schedules)

    def plan(self, layout: Layout, memory=None) -> dict:
        """The prediction of one layout as the JSON object (see `describe`)."""
        memory = memory or self.memory(layout)
        facts = self.facts(layout)
        step = predict_step(self.spec, layout, self.hardware, facts, schedule_cache=self.schedules)
        tight = memory.tightest
        return {
            "layout": layout.describe(),
            "layout_fields": {k: getattr(layout, k) for k in ("tp", "pp", "dp", "cp", "cp_method", "ep", "expert_tp",
                                                              "moe_imbalance",
                                                              "micro_batch", "global_batch", "zero",
                                                              "recompute", "schedule", "chunks", "partition",
                                                              "sequence_parallel",
                                                              "offload_optimizer", "offload_param", "precision",
                                                              "hierarchical", "ranks_per_node", "onebit",
                                                              "quantized_weights", "hpz", "quantized_gradients")},
            "params": facts.total_params, "active_params": active_params(self.spec, facts.total_params),
            "memory_gb_per_gpu": tight.total / GB, "tightest_stage": tight.stage,
            "memory_gb_per_stage": [st.total / GB for st in memory.stages],
            "memory_breakdown_gb": [{k: v / GB for k, v in {**st.breakdown, **st.transient,
                                                             "fragmentation": st.fragmentation}.items() if v}
                                    for st in memory.stages],
            "hbm_gb": self.hardware.hbm_bytes / GB, "fits": memory.fits,
            "over_gb": {str(s): gb for s, gb in memory.over},
            "step_time_s": step.step_time_s, "tokens_per_s": step.tokens_per_s,
            "model_tflops_per_gpu": step.model_tflops_per_gpu, "hardware_tflops_per_gpu": step.hardware_tflops_per_gpu,
            "mfu": step.mfu, "bubble_fraction": step.bubble_fraction, "critical_stage": step.critical_stage,
            "breakdown": dict(step.breakdown), "dp_bytes_per_gpu": step.dp_bytes,
            "internode_bytes_per_gpu": step.internode_bytes, "cp_bytes_per_gpu": step.cp_bytes,
            "cp_internode_bytes_per_gpu": step.cp_internode_bytes, "_memory": memory,
        }


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def describe(spec, hardware, result: dict) -> str:
    """The text report of one plan."""
    active = (f" ({result['active_params'] / 1e9:.2f}B active per token)"
              if result["active_params"] != result["params"] else "")
    lines = [f"model    {spec.name}: {result['params'] / 1e9:.2f}B parameters{active}",
             f"layout   {result['layout']} on {hardware.name}",
             "", "memory per GPU (GB; * = tightest stage, fragmentation allowance included in total)",
             result["_memory"].table(), "",
             f"step     {result['step_time_s']:.3f} s, {result['tokens_per_s']:,.0f} tokens/s, "
             f"{result['model_tflops_per_gpu']:.1f} model TFLOP/s per GPU, {result['hardware_tflops_per_gpu']:.1f} "
             f"hardware TFLOP/s per GPU (recompute counted), MFU {result['mfu']:.1%}, bubble "
             f"{result['bubble_fraction']:.1%}",
             f"         breakdown on stage {result['critical_stage']}: " + ", ".join(
                 f"{k} {v:.3f} s" for k, v in result["breakdown"].items() if abs(v) > 5e-4),
             f"comm     {result['dp_bytes_per_gpu'] / GB:.3f} GB per GPU per step over data parallel; across nodes "
             f"{result['internode_bytes_per_gpu'] / GB:.3f} GB (data parallel and tied embeddings)"
             + (f"; context parallel {result['cp_bytes_per_gpu'] / GB:.3f} GB, across nodes "
                f"{result['cp_internode_bytes_per_gpu'] / GB:.3f} GB" if result["cp_bytes_per_gpu"] else "")]
    return "\n".join(lines)


def choose_chunks(planner: Planner, layout: Layout) -> tuple[dict, str]:
    """(the plan, a line saying why) of the interleaved `layout` with the chunk count that is fastest among
    those that fit (fastest overall when none fits), over `CHUNKS` where the layout is valid; PlanError
    naming every count's problem when none is."""
    plans, problems = [], []
    for v in CHUNKS:
        candidate = layout.replace(chunks=v)
        errs = candidate.problems(planner.spec)
        if errs:
            problems.append(f"V={v}: " + "; ".join(errs))
            continue
        plans.append((v, planner.plan(candidate)))
    if not plans:
        raise PlanError(f"--schedule interleaved: no chunk count in {', '.join(map(str, CHUNKS))} runs "
                        f"{layout.describe()}: " + " | ".join(problems))
    fitting = [vp for vp in plans if vp[1]["fits"]] or plans
    v, best = max(fitting, key=lambda vp: vp[1]["tokens_per_s"])
    tried = ", ".join(f"V={u} {r['tokens_per_s']:,.0f} tokens/s{'' if r['fits'] else ' (does not fit)'}"
                      for u, r in plans)
    return best, f"interleaved with V={v} chunks per stage, the fastest {'that fits ' if best['fits'] else ''}of: {tried}"


def search(planner: Planner, args, fixed: dict) -> tuple[list[dict], list[tuple[str, str]]]:
    """(plans that fit, fastest first; (layout, why) of the others). Every generated layout gets its
    memory plan; those that fit are sorted by `estimate_step_time` (closed-form bubble), and the best
    max(3 x top, 30) of them are timed through the simulator (`predict_step`) and ranked by it."""
    fitting, rejected = [], []
    hw = planner.hardware
    for layout in candidates(planner.spec, args.gpus, args.global_batch, fixed.get("ranks_per_node") or hw.gpus_per_node,
                             fixed,
                             offload=bool(fixed.get("offload_optimizer")), precision=args.precision):
        memory = planner.memory(layout)
        if memory.fits:
            facts = planner.facts(layout)
            fitting.append((estimate_step_time(planner.spec, layout, hw, facts), layout, memory))
        else:
            stage, gb = max(memory.over, key=lambda sg: sg[1])
            rejected.append((layout.describe(), f"stage {stage} needs {memory.stages[stage].total / GB:.1f} GB, "
                                                f"{gb:.1f} GB over the {hw.hbm_bytes / GB:.1f} GB of a GPU"))
    if not fitting and not rejected:
        layout = one_layout(args, fixed)  # why even the plainest layout with the fixed choices cannot run
        raise PlanError(f"no layout of {planner.spec.name} runs on {args.gpus} GPUs with global batch "
                        f"{args.global_batch} and the given flags; e.g. {layout.describe()}: "
                        + "; ".join(layout.problems(planner.spec) or ["(none generated)"]))
    fitting.sort(key=lambda item: item[0])
    fits = [planner.plan(layout, memory) for _, layout, memory in fitting[:max(3 * args.top, 30)]]
    fits.sort(key=lambda r: r["tokens_per_s"], reverse=True)
    return fits, rejected, len(fitting)


def calibrate_main(argv) -> int:
    """``plan.py --calibrate OUT.yaml [--ranks N] [--repeats R]``: measure this machine (megazero.toolbox.calibrate)."""
    p = argparse.ArgumentParser(prog="python tools/plan.py --calibrate",
                                description="measure this machine and write the hardware file to plan with")
    p.add_argument("--calibrate", required=True, metavar="OUT.yaml", help="the hardware file to write")
    p.add_argument("--ranks", type=int, default=8, help="ranks the runs you plan put on this machine (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement (default 5)")
    p.add_argument("--name", default=None, help="the machine's name in the file")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.repeats < 1:
        print(f"error: --ranks and --repeats must be >= 1, got {args.ranks} and {args.repeats}", file=sys.stderr)
        return 2
    from megazero.toolbox import calibrate

    name = args.name or f"{platform.processor() or platform.machine()} x {args.ranks} ranks (calibrated)"
    content = calibrate.probe(args.ranks, args.repeats, name)
    calibrate.write(args.calibrate, content, args.ranks)
    eff = content["efficiency"]
    print(f"wrote {args.calibrate}: peak_tflops {content['peak_tflops']:.3f} (16-bit; fp32 at half), gemm_max "
          f"{eff['gemm_max']}, gemm_k_half {eff['gemm_k_half']}; memory {content['hbm_bandwidth_tbs'] * 1e3:.1f} GB/s; "
          f"collectives {content['nvlink_gbs']:.2f} GB/s bus, {eff['ring_base_us']:.0f} us + {eff['nvlink_hop_us']:.0f} us "
          f"per step; p2p {eff['collective_us']:.0f} us; host {eff['host_op_us']} us per operator, in-step "
          f"{eff['in_step']}")
    return 0


def main(argv=None, hardware_dir: str = "configs/hardware", spec_dir: str = "model_specs") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--calibrate" or a.startswith("--calibrate=") for a in argv):
        return calibrate_main(argv)
    args = parser().parse_args(argv)
    try:
        if args.gpus < 1 or args.global_batch < 1:
            raise PlanError(f"--gpus and --global-batch must be >= 1, got {args.gpus} and {args.global_batch}")
        spec = load_spec(spec_ref(args.spec, spec_dir), args.overrides)
        hardware = load_hardware(args.hardware, hardware_dir)
        fixed = fixed_choices(args)
        planner = Planner(spec, hardware)
        if args.search:
            fits, rejected, fitting = search(planner, args, fixed)
            if args.json:
                print(json.dumps({"fitting": fitting, "fits": [_public(r) for r in fits],
                                  "rejected": [{"layout": lay, "why": why} for lay, why in rejected]}, indent=1))
            else:
                print(f"{fitting} layouts fit, {len(rejected)} do not ({spec.name}, {args.gpus} x {hardware.name}, "
                      f"global batch {args.global_batch}); the {len(fits)} fastest by estimate, timed by the simulator:")
                for i, r in enumerate(fits[:args.top]):
                    print(f"{i + 1:>3}. {r['layout']:<58} {r['tokens_per_s']:>12,.0f} tokens/s  MFU {r['mfu']:.1%}  "
                          f"{r['memory_gb_per_gpu']:.1f} GB (stage {r['tightest_stage']})")
                for lay, why in rejected[:args.top]:
                    print(f"  does not fit: {lay}: {why}")
                if len(rejected) > args.top:
                    print(f"  ... and {len(rejected) - args.top} more that do not fit (--json lists all)")
            return 0 if fits else 1
        layout = one_layout(args, fixed)
        chosen = ""
        if layout.schedule == "interleaved" and "chunks" not in fixed:
            result, chosen = choose_chunks(planner, layout)
        else:
            result = planner.plan(layout)
        if args.json:
            print(json.dumps({**_public(result), **({"chunks_chosen": chosen} if chosen else {})}, indent=1))
        else:
            print(describe(spec, hardware, result) + (f"\nchunks   {chosen}" if chosen else ""))
        return 0 if result["fits"] else 1
    except (PlanError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

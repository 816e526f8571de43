"""zero_step: one small GPT trained at ZeRO 0-3 and ZeRO-Offload through megazero's DeepSpeed API
(`import megazero as deepspeed`) against DeepSpeed itself with the same config dict, torch DDP (stage
0) and FSDP2 (`fully_shard`, stage 3), at 2 and 4 ranks, and one process on the same global batch.

Method: each launch (one ZeRO setting, one world size) builds every contestant once in the same rank
processes from the same seed, warms each up, then times windows of steps A/B/C, A/B/C, ... so that a
neighbour's load falls on all of them alike. A window's step time is the slowest rank's median step;
ratios are megazero / peer per window pair. "single" is one process training plain PyTorch on the
whole global batch with all the cores: rank 0 runs it while the other ranks wait, in the same
interleaving. Every contestant sees the same global batches in the same order, so the losses of all
steps must agree (rank mean, rel 1e-4 fp32) before a ratio is shown.
"""
from __future__ import annotations

import sys

import torch

from benchmarks import _common as C
from benchmarks.cases.models import GPTSize, gpt, token_batches

TOL = 1e-4
LR, WEIGHT_DECAY = 1e-3, 0.01
SETTINGS = {"zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
            "zero2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
TORCH_PEER = {"zero0": "ddp", "zero3": "fsdp2", "zero0-smoke": "ddp"}
SMOKE = {"zero0-smoke": {"stage": 0}}
"""--tiny's setting: ZeRO-0 with DeepSpeed on torch's AdamW (``torch_adam``) and without its shared-memory
comm op, so that a smoke run on a fresh machine does not wait ~2 minutes for DeepSpeed's JIT builds; the
real runs keep both."""


def ds_config(zero: dict, micro: int, torch_adam: bool = False) -> dict:
    """The one config both megazero and DeepSpeed read (clipping off in both: DeepSpeed's default is 1.0)."""
    params = {"lr": LR, "weight_decay": WEIGHT_DECAY} | ({"torch_adam": True} if torch_adam else {})
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": dict(zero), "steps_per_print": 10 ** 9}


def _engine_step(engine, batches):
    it = iter(batches)

    def step():
        x, y = next(it)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def _torch_step(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    it = iter(batches)

    def step():
        x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _single_step(size: GPTSize, batches):
    """One process on the whole global batch: rank 0 trains plain PyTorch with all the machine's
    cores while the other ranks wait at the barrier (their step is empty)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return lambda: float("nan")
    inner = _torch_step(gpt(size, seed=0), batches)

    def step():
        threads = torch.get_num_threads()
        torch.set_num_threads(C.threads_per_rank(1))
        try:
            return inner()
        finally:
            torch.set_num_threads(threads)
    return step


def build(name: str, size: GPTSize, zero: dict, micro: int, mine, full, torch_adam: bool = False):
    """Contestant `name`'s step function on this rank (`mine`: this rank's micro-batches, `full`:
    the global batches)."""
    import torch.distributed as dist

    if name == "single":
        return _single_step(size, full)
    model = gpt(size, seed=0)
    if name == "megazero":
        import megazero as deepspeed
    elif name == "deepspeed":
        import deepspeed
        if torch_adam:  # the smoke run: no JIT build of the shared-memory op, used by inference all-reduce only
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if name in ("megazero", "deepspeed"):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(zero, micro, torch_adam))
        return _engine_step(engine, mine)
    if name == "ddp":
        return _torch_step(torch.nn.parallel.DistributedDataParallel(model), mine)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _torch_step(model, mine)
    raise ValueError(name)


def worker(names, size, zero, micro, warmup, repeats, window, torch_adam=False):
    """On each rank: build every contestant (recording why one cannot be built), then time them
    interleaved. Returns {"timed": {name: ...}, "absent": {name: reason}}."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    full = token_batches(size, micro * world, warmup + repeats * window)
    mine = [(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]) for x, y in full]
    contestants, absent = {}, {}
    for name in names:
        try:
            contestants[name] = build(name, size, zero, micro, mine, full, torch_adam)
        except Exception as err:  # noqa: BLE001 - a peer that cannot run is recorded; the rest runs
            absent[name] = C.failure(err)
        dist.barrier()
    timed = C.interleaved_windows(contestants, warmup, repeats, window, sync=dist.barrier)
    return {"timed": timed, "absent": absent}


def step_losses(timed, name):
    """Each step's loss, warm-up steps included: the rank mean (the single process: rank 0's)."""
    steps = [r[name]["warmup_losses"] + r[name]["losses"] for r in (timed[:1] if name == "single" else timed)]
    return [sum(r[i] for r in steps) / len(steps) for i in range(len(steps[0]))]


def measure(setting: str, world: int, size: GPTSize, micro: int, warmup: int, repeats: int, window: int) -> dict:
    names = ["megazero", "deepspeed"] + ([TORCH_PEER[setting]] if setting in TORCH_PEER else []) + ["single"]
    print(f"[bench] zero_step {setting} at {world} ranks: {', '.join(names)}", file=sys.stderr, flush=True)
    try:
        per_rank = C.run_ranks(worker, world, names, size, {**SETTINGS, **SMOKE}[setting], micro, warmup, repeats,
                               window, setting in SMOKE)
    except Exception as err:  # noqa: BLE001
        return {"error": C.failure(err)}
    absent = per_rank[0]["absent"]
    timed = [r["timed"] for r in per_rank]
    if "megazero" in absent:
        return {"error": "megazero: " + absent["megazero"], "absent": absent}
    tokens = micro * world * size.seq
    out = {"world": world, "micro_batch_per_rank": micro, "global_batch": micro * world, "absent": absent,
           "step_s": {}, "tokens_per_s": {}, "checks": {}, "ratios": {}}
    ours, ref_losses = C.slowest_rank(timed, "megazero"), step_losses(timed, "megazero")
    for name in [n for n in names if n not in absent]:
        secs = C.slowest_rank(timed, name)
        out["step_s"][name] = C.spread(secs)
        out["tokens_per_s"][name] = C.spread([tokens / s for s in secs], 1)
        if name == "megazero":
            continue
        check = C.check_equal(f"megazero vs {name}", ref_losses, step_losses(timed, name), TOL)
        out["checks"][name] = check
        out["ratios"][f"megazero/{name}"] = C.ratio(ours, secs) if check["ok"] else None
    return out


def sizes(args) -> tuple[GPTSize, int, int, int, list[int], list[str]]:
    """(model, global batch, warm-up steps, steps per window, world sizes, settings)."""
    if args.tiny:
        return GPTSize(layers=1, hidden=32, heads=2, vocab=64, seq=16), 4, 1, 1, [2], ["zero0-smoke"]
    return GPTSize(), 8, 2, 2, [2, 4], list(SETTINGS)


def rows(results: dict) -> list[dict]:
    out = []
    for key, res in results.items():
        if "error" in res:
            out.append({"case": "zero_step", "what": key, "check": "failed: " + res["error"].splitlines()[0][:160]})
            continue
        for peer in [n for n in res["step_s"] if n != "megazero"] + [n for n in res["absent"]]:
            check = res["checks"].get(peer)
            label = "one process, plain torch, all cores" if peer == "single" else peer
            out.append({"case": "zero_step", "what": f"{key} step vs {label}",
                        "megazero": C.fmt(res["step_s"]["megazero"], " s"),
                        "peer": C.fmt(res["step_s"].get(peer), " s") if peer not in res["absent"] else "absent",
                        "ratio": C.fmt(res["ratios"].get(f"megazero/{peer}")),
                        "check": (res["absent"][peer].splitlines()[0][:160] if peer in res["absent"] else
                                  f"losses rel {check['max_rel_diff']:.1e} {'<=' if check['ok'] else '>'} {TOL:g}")})
    return out


def case(args) -> dict:
    size, global_batch, warmup, window, worlds, settings = sizes(args)
    repeats = args.repeats
    results = {}
    for world in worlds:
        for setting in settings:
            results[f"{setting}_ranks{world}"] = measure(setting, world, size, global_batch // world, warmup,
                                                         repeats, window)
    return {"model": {**size.__dict__, "params": size.params(), "dtype": "fp32"},
            "global_batch": global_batch, "tokens_per_step": global_batch * size.seq, "warmup_steps": warmup,
            "steps_per_window": window, "repeats": repeats, "tolerance": TOL,
            "method": __doc__.split("\n\n", 1)[1].strip(), "results": results, "rows": rows(results)}

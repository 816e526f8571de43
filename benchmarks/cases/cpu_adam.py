"""cpu_adam: `benchmarks/cpu_adam.py` as a subprocess (megazero's SIMD Adam vs torch AdamW foreach /
fused vs DeepSpeedCPUAdam, against the STREAM bandwidth limit; its own rounds interleave them). Its
JSON is kept as it is under "output"; every "ratios" section found in it is summarised as
megazero / peer step time (that script reports speed-ups, peer time / megazero time; the inverse of
a per-round spread is exact: median -> 1/median, min <-> 1/max), next to the step times of its
sibling "results" section. Missing keys are tolerated.

Check (here, not in that script): megazero's `adam_step`, torch's AdamW (foreach, fused) and
DeepSpeedCPUAdam take 3 steps from the same parameters and gradients (100,003 fp32 elements, the
same hyper-parameters); each peer's parameters must equal megazero's within 1e-3 of the largest
move Adam made (fp32 rounding of differently ordered formulas), or its ratio is withheld.
"""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import _common as C

SCRIPT = C.ROOT / "benchmarks" / "cpu_adam.py"
TOL = 1e-3  # of the largest parameter move
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def check_worker(n: int = 100_003, steps: int = 3) -> dict:
    """{peer: max |p_peer - p_megazero| / max |p_megazero - p0|, or the reason it could not run}."""
    import torch

    from megazero.runtime.kernels import adam_step

    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(steps)]
    ours, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for t, grad in enumerate(grads, 1):
        adam_step(ours, grad, m, v, step=t, lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                  eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
    move = (ours - p0).abs().max().item()

    def torch_adamw(**kw):
        return lambda ps: torch.optim.AdamW(ps, **kw, **HYPER)

    def deepspeed_adam(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER)

    out = {}
    for peer, make in {"torch_adamw_foreach": torch_adamw(foreach=True), "torch_adamw_fused": torch_adamw(fused=True),
                       "deepspeed_cpu_adam": deepspeed_adam}.items():
        try:
            q = torch.nn.Parameter(p0.clone())
            opt = make([q])
            for grad in grads:
                q.grad = grad.clone()
                opt.step()
            out[peer] = (q.detach() - ours).abs().max().item() / move
        except Exception as err:  # noqa: BLE001
            out[peer] = C.failure(err)
    return out


def _check_of(peer: str, checks: dict) -> dict:
    base = peer.split("+")[0]  # "+bf16_copy" rows run the same update, then a copy
    if base.startswith("megazero"):
        return {"ok": True, "text": "the same megazero kernel"}
    got = checks.get(base)
    if got is None:
        return {"ok": False, "text": "no agreement check for this peer: ratio withheld"}
    if isinstance(got, str):
        return {"ok": False, "text": f"check could not run: {got.splitlines()[0][:120]}"}
    ok = got <= TOL
    return {"ok": ok, "max_diff_over_move": float(f"{got:.3g}"), "tolerance": TOL,
            "text": f"params after 3 steps: |diff| {got:.1e} of the move {'<=' if ok else '>'} {TOL:g}"}


def _flags(args) -> list[str]:
    """Only the flags the script still has (another engineer is changing it)."""
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    wanted = {"--rounds": str(max(args.repeats, 1))}
    if args.tiny:
        wanted.update({"--params": "1000000", "--rounds": "1", "--steps": "1"})
    out = []
    for flag, value in wanted.items():
        if flag in help_text:
            out += [flag, value]
    return out


def _ratio_sections(obj, path=()):
    """(path, {name: spread}, the mapping holding it) of every "ratios" mapping anywhere in the output."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "ratios" and isinstance(value, dict):
                yield path, value, obj
            else:
                yield from _ratio_sections(value, path + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _ratio_sections(value, path + (str(i),))


def _inverse(s):
    if not isinstance(s, dict) or not all(isinstance(s.get(k), (int, float)) and s.get(k) for k in
                                          ("median", "min", "max")):
        return None
    return {"median": round(1 / s["median"], 3), "min": round(1 / s["max"], 3), "max": round(1 / s["min"], 3)}


def case(args) -> dict:
    if not SCRIPT.exists():
        return {"error": f"{SCRIPT} not found"}
    cmd = [sys.executable, str(SCRIPT), *_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.ROOT, timeout=1800)
    if proc.returncode != 0:
        return {"command": cmd[1:], "error": f"exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    try:
        output = json.loads(proc.stdout[proc.stdout.index("{"):])
    except ValueError as err:
        return {"command": cmd[1:], "error": f"no JSON object in its output ({err}): {proc.stdout[-500:]}"}
    try:
        checks = C.run_ranks(check_worker, 1)[0]
    except Exception as err:  # noqa: BLE001
        checks = {"error": C.failure(err)}
    summary, rows = {}, []
    for path, ratios, section in _ratio_sections(output):
        where = "/".join(path) or "main"
        results = section.get("results")
        layout = (f"{section['tensors']} x {section.get('params_per_tensor', '?')}" if "tensors" in section
                  else str(section.get("params", output.get("params", "?"))))
        for name, speedup in ratios.items():
            ours, _, peer = name.partition("_vs_")
            check = _check_of(peer, checks)
            inv = _inverse(speedup) if check["ok"] else None
            summary[f"{where}:{name}"] = {"speedup_peer_over_megazero": speedup, "megazero_over_peer_time": inv,
                                          "check": check}
            rows.append({"case": "cpu_adam", "what": f"{where}: {ours} vs {peer} ({layout} params, step time)",
                         "megazero": C.fmt(_step_ms(results, ours), " ms"), "peer": C.fmt(_step_ms(results, peer), " ms"),
                         "ratio": C.fmt(inv), "check": check["text"]})
    params = output.get("params")
    notes = [f"{k}: {v}" for k, v in (output.get("peers_absent") or {}).items()]
    if not rows:
        notes.append("no ratios section found in benchmarks/cpu_adam.py's output")
    return {"command": cmd[1:], "params": params, "agreement": {"tolerance_of_move": TOL, "max_diff_over_move": checks},
            "ratios_summary": summary, "output": output, "rows": rows, "notes": notes}


def _step_ms(results, name):
    entry = results.get(name) if isinstance(results, dict) else None
    return entry.get("step_ms") if isinstance(entry, dict) and isinstance(entry.get("step_ms"), dict) else None

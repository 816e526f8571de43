"""1-bit Adam against AdamW on the debug GPT: both loss curves, the bytes each moves per step over dp.

    python benchmarks/onebit_curves.py --out docs/images/onebit-adam   # writes .json and .png

The same run as tests/test_onebit_adam.py: 4 data-parallel ranks (gloo, this machine), ZeRO-0, the
GPT debug model on a real-text corpus (the Python standard library as bytes), 300 steps of 16
sequences of 64 tokens, lr 1e-3; 1-bit Adam's warm-up is the first 100 steps. The picture plots each
step's loss and a 20-step running mean of both runs and marks the end of the warm-up.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common as C  # noqa: E402

STEPS, FREEZE, RANKS = 300, 100, 4


def train(cfg: dict, steps: int):
    """Per-step losses and dp bytes (rank 0's)."""
    import megazero

    engine, _, data, _ = megazero.initialize(config=cfg)
    losses, moved = [], []
    for _ in range(steps):
        before = engine.pctx.stats.total(axis="dp").bytes
        losses.append(engine.train_batch(data))
        moved.append(engine.pctx.stats.total(axis="dp").bytes - before)
    return losses, moved


def _mean20(xs):
    return [sum(xs[max(0, i - 19):i + 1]) / len(xs[max(0, i - 19):i + 1]) for i in range(len(xs))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output path without suffix (.json and .png are written)")
    args = ap.parse_args(argv)
    from megazero.data import demo_corpus, preprocess

    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "stdlib")
        preprocess(lambda: demo_corpus(300_000), prefix)
        base = {"model": {"spec": "model_specs/gpt.py:debug", "vocab": 257, "seq_len": 64}, "data": {"path": prefix},
                "train": {"micro_batch_size": 4, "global_batch_size": 16, "seed": 1}, "zero": {"stage": 0}}
        runs = {}
        for name, opt in (("AdamW", {"type": "adamw", "lr": 1e-3}),
                          ("1-bit Adam", {"type": "onebit_adam", "lr": 1e-3, "freeze_step": FREEZE})):
            losses, moved = C.run_ranks(train, RANKS, dict(base, optimizer=opt), STEPS, timeout=1800)[0]
            runs[name] = {"losses": losses, "dp_bytes_per_step": moved}
    final = {k: sum(v["losses"][-20:]) / 20 for k, v in runs.items()}
    after = {k: sum(v["dp_bytes_per_step"][FREEZE + 1:]) / len(v["dp_bytes_per_step"][FREEZE + 1:]) for k, v in runs.items()}
    summary = {"final_loss_mean_of_last_20": final, "1bit_over_adamw": final["1-bit Adam"] / final["AdamW"],
               "dp_bytes_per_step_after_warmup": after, "bytes_ratio": after["AdamW"] / after["1-bit Adam"],
               "steps": STEPS, "freeze_step": FREEZE, "ranks": RANKS}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    for (name, run), color in zip(runs.items(), ("#1f77b4", "#d62728")):
        ax.plot(run["losses"], color=color, alpha=0.25, linewidth=0.8)
        ax.plot(_mean20(run["losses"]), color=color, label=f"{name} (last 20 steps: {final[name]:.3f})")
    ax.axvline(FREEZE, color="gray", linestyle="--", linewidth=0.8)
    ax.text(FREEZE + 3, ax.get_ylim()[1] * 0.97, "1-bit from here", va="top", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"debug GPT, {RANKS} data-parallel ranks: 1-bit Adam moves {summary['bytes_ratio']:.0f}x fewer "
                 f"bytes per step", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

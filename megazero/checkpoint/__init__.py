"""Checkpoints that reshard: model weights are stored by logical name at full size, so any
PP x TP x DP layout (and any ZeRO stage) can load them.

Layout on disk (`<dir>/step<N>/`):
- `model_pp<s>.pt`: {logical_name: full fp32 tensor} of pipeline stage s's layers (written by the
  rank with dp = 0, tp = 0 of that stage after gathering the TP shards; ZeRO-3 shards are gathered
  over dp first). A tied embedding/head appears in the first and last stage's files, equal.
- `optimizer_rank<r>.pt`: this rank's optimizer state (fp32 master and Adam moments of its shard,
  step, loss scaler, LR schedule): exact resume in the same layout.
- `meta.json`: step, layout, config.
`load_weights(dir, module, optimizer)` reads the weights of every file into any layout; `load`
also restores the optimizer state when the layout and ZeRO stage are the saved ones.
"""
from .io import latest, load, load_weights, save

__all__ = ["save", "load", "load_weights", "latest"]

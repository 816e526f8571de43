"""Tensor parallelism: the f/g operators, parallel layers, vocab-parallel cross-entropy, RNG streams.

Every function and layer receives its TP group (a `megazero.runtime.comm.GroupHandle`) as an argument.
"""
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.init import make_param, padded_size, stable_seed
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_parallel_region)
from megazero.tensor_parallel.mappings import (
    copy_to_tp_region, enter_tp_region, exit_tp_region, gather_from_sequence_parallel_region,
    gather_from_tp_region, reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tp_region)
from megazero.tensor_parallel.params import (
    counts_once_in_norm, gather_full_grads, gather_full_params, gather_full_tensors, load_full_params, num_logical_params,
    sync_sequence_parallel_grads, unique_params)
from megazero.tensor_parallel.random import (
    REPLICATED_STREAM, TP_STREAM, Dropout, LogicalMaskFn, RNGStatesTracker, ShardInfo, set_dropout_mask_fn)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_region",
    "vocab_parallel_cross_entropy",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "enter_tp_region", "exit_tp_region",
    "make_param", "padded_size", "stable_seed", "gather_full_params", "gather_full_grads", "gather_full_tensors",
    "load_full_params", "sync_sequence_parallel_grads", "unique_params", "counts_once_in_norm",
    "num_logical_params", "RNGStatesTracker", "Dropout", "ShardInfo", "LogicalMaskFn",
    "set_dropout_mask_fn", "TP_STREAM", "REPLICATED_STREAM",
]

"""Activation checkpointing: full (per layer or per segment of k layers), selective (attention core),
with checkpoints partitioned across the TP group, kept on the host, or packed in one contiguous buffer.

See checkpointer.py for the policies, region.py for how a region drops and recomputes what it saves
(and replays the random state), storage.py for where kept inputs live.
"""
from megazero.activation_checkpoint.checkpointer import (POLICIES, ActivationCheckpointer, CheckpointedBlock,
                                                         CheckpointOptions, segment_sizes)
from megazero.activation_checkpoint.region import CheckpointStats, Frame, RNGSnapshot
from megazero.activation_checkpoint.storage import HOST_TAG, CheckpointStore, ContiguousPool

__all__ = ["POLICIES", "ActivationCheckpointer", "CheckpointedBlock", "CheckpointOptions",
           "segment_sizes", "CheckpointStats", "Frame", "RNGSnapshot", "HOST_TAG", "CheckpointStore",
           "ContiguousPool"]

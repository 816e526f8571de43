"""DeepSpeed's `deepspeed.comm` import path (`megazero.compat.dist_api`): torch.distributed under
DeepSpeed's names, with the comms logger."""
from megazero.compat.dist_api import (CommsLogger, ReduceOp, all_gather, all_gather_into_tensor, all_gather_object,
                                      all_reduce, all_reduce_coalesced, all_to_all, all_to_all_single, allgather_fn,
                                      barrier, batch_isend_irecv, broadcast, broadcast_object_list, comms_logger,
                                      configure, destroy_process_group, gather, get_all_ranks_from_group,
                                      get_comm_operation_count, get_global_rank, get_local_rank, get_logged_comm_ops,
                                      get_rank, get_world_group, get_world_size, has_all_gather_into_tensor,
                                      has_all_reduce_coalesced, has_coalescing_manager, has_comm_data,
                                      has_reduce_scatter_tensor, init_distributed, irecv, is_available,
                                      is_initialized, isend, log_summary, monitored_barrier, new_group, recv, reduce,
                                      reduce_scatter, reduce_scatter_fn, reduce_scatter_tensor, reset_log, scatter,
                                      send)

__all__ = [n for n in dir() if not n.startswith("_")]

"""DeepSpeed's `deepspeed.monitor` import path (`megazero.compat.monitor`)."""
from megazero.compat.monitor import CsvMonitor, MonitorMaster, TensorBoardMonitor, WandbMonitor

__all__ = ["MonitorMaster", "TensorBoardMonitor", "CsvMonitor", "WandbMonitor"]

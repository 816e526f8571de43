"""DeepSpeed's `deepspeed.runtime.zero` import path: its memory estimators (`stage3`, `stage_1_and_2`,
from `megazero.compat.zero_estimators`). megazero's ZeRO itself is `megazero.zero`."""

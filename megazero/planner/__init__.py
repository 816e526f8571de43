"""The planner: memory per GPU and step time of a layout before launch (pure: no torch, no processes).

`Layout` (layout.py) is a PP x TP x DP x CP layout with its batch, ZeRO, recompute, schedule, offload and
context-parallel choices; `Hardware` (hardware.py) a GPU and its network. memory_plan.py predicts the bytes each pipeline
stage holds, speed.py the step time and its breakdown, search.py ranks every layout that fits. The
parameter counts come from the model built on the meta device (`megazero.toolbox.model_facts`), handed
in as numbers: this package never imports torch.
"""

"""Pipeline parallelism.

Pure parts (no torch): `instructions` (the instruction dataclasses programs are made of),
`schedules` (GPipe, 1F1B, interleaved 1F1B, ZB-H1, CSV schedules), `simulate` (runs all stages'
programs together with blocking p2p, reports bubble and deadlocks) and `partition` (layers ->
stages). Import those submodules directly; this package file imports nothing so that
`import megazero.pipeline.schedules` stays free of torch.
"""

"""L4, checkpoints: megazero's sharded, reshardable checkpoint format and everything that writes or reads it.

- `sharded`: `save` and `load` (any layout into any other), the manifest (`read_manifest`, `resolve`,
  `has_checkpoint`), asynchronous saves (`PendingSave`), the RNG states a checkpoint carries;
- `read`: the stored boxes read back (`Readers`, `copy_overlaps`, `CheckpointError`);
- `convert`: one logical tensor at a time: `consolidate`, Hugging Face `export_hf` / `import_hf`;
- `safetensors_io`: safetensors files written one tensor in memory at a time;
- `failure_save`: checkpoint.save_on_failure's writing part (`save_parts`, `promote`); what decides to
  call it is in `megazero.resilience`.

The engine's DeepSpeed methods (`megazero.engine.checkpointing`) and DeepSpeed's `zero_to_fp32`
(`megazero.compat.zero_to_fp32`) are views over these. Import the submodules directly; this file
imports nothing.
"""

"""L4, resilience: what keeps a weeks-long run honest and recoverable.

- `silent_check`: a step's gradients computed twice, the rank that computed a wrong number named;
- `stragglers`: every rank's step times gathered every resilience.straggler_interval steps, slow ranks named;
- `link_probe`: a ping-pong over each ring link of the pp, dp and tp groups, slow links named;
- `on_failure`: checkpoint.save_on_failure's trigger in the trainer (`SaveOnFailure`): a failed step saves
  this rank's state before it re-raises, SIGTERM fails the step, the next start promotes the saved parts
  (the saving is `megazero.checkpoint.failure_save`).

Import the submodules directly; this file imports nothing.
"""

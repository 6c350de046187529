"""Round checkpoints: written atomically in the background, sealed with a manifest of every
file's digest, verified before any use, found again and pruned.

- `rounds`: a checkpoint's layout, `save` and `restore` of a trainer's state, the save
  points and pruning;
- `writer`: the `CheckpointWriter` thread that copies the state off the device and writes
  it while training goes on, each rank its part, rank 0 sealing the whole;
- `verify`: the manifest check, and finding the checkpoints a run may start from;
- `adapters`: LoRA checkpoints (the adapters and a pointer to the base weights);
- `engine_state`: DeepSpeed's engine state read back weights-only (no pickled code runs);
- `tensor_files`: safetensors files and nested states written and read in parallel pieces,
  hashed as written; `pieces`: the I/O threads, staging buffers and digests under them.

May import: `rlhf.config`, `rlhf.models`, `rlhf.trainer`, `rlhf.round` (the `RoundState`
a checkpoint holds). Never tracking or the drivers (`rlhf.train`). Submodules are imported
directly (`from rlhf.checkpoint import rounds as ckpt`).
"""

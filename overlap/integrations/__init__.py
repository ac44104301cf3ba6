"""Training with `ShardedModule` inside the frameworks people already use.

- `overlap.integrations.lightning`: `OverlapStrategy` for `lightning.pytorch.Trainer`.
- `overlap.integrations.fabric`: `OverlapFabricStrategy` for `lightning.fabric.Fabric`.
- `overlap.integrations.hf`: `OverlapTrainer`, a `transformers.Trainer` that trains the model
  sharded (no DDP around it) and writes sharded checkpoints.

Nothing is imported here: `import overlap` and `import overlap.integrations` never import
Lightning or transformers; each module imports its own framework (the `[lightning]` and `[hf]`
extras).
"""

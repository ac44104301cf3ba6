"""The main job, `overlap train`: a small GPT trained with `ShardedModule`.

Imports: the public API, `overlap.checkpoint`, `overlap.models`, `overlap.observe`, `overlap.base`.
"""

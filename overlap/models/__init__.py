"""Small reference models used by the main job, the examples, tests and benchmarks."""
from overlap.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]

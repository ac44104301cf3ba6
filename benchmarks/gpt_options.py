"""The benchmark GPT as the scripts take it: options, the smoke runs' model, synthetic batches."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from overlap.models import GPTConfig

MODEL_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")
# GPTConfig's defaults (23.2M parameters), written out so that a driver need not import overlap.
BENCHMARK_MODEL = dict(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, block_size=128)
# A smoke run's model: seconds a step.
SMALL_MODEL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)


def add_model_options(parser: argparse.ArgumentParser, defaults: dict[str, int]) -> None:
    for field in MODEL_FIELDS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=defaults[field])


def model_config(args: argparse.Namespace) -> "GPTConfig":
    from overlap.models import GPTConfig

    return GPTConfig(**{field: getattr(args, field) for field in MODEL_FIELDS})


def token_batch(args: argparse.Namespace, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`args.batch` random sequences (inputs, targets) per rank and step, the same for every implementation."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    tokens = torch.randint(args.vocab_size, (args.batch, args.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def token_step(model: Any, optimizer: torch.optim.Optimizer, config: "GPTConfig", batch: int, seed: int,
               drawn_first: int = 0) -> Callable[[], torch.Tensor]:
    """One training step of the GPT `model` on `batch` random sequences (next-token targets) from a
    generator seeded `seed`; the loss. `drawn_first`: that many batches drawn before, none in a step."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=generator)  # noqa: E731
    tokens = iter([draw() for _ in range(drawn_first)]).__next__ if drawn_first else draw

    def step() -> torch.Tensor:
        drawn = tokens()
        loss = model(drawn[:, :-1], drawn[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def gpt_config(params: float, layers: int) -> "GPTConfig":
    """A GPT config of about `params` parameters with `layers` blocks (width a multiple of 64)."""
    from overlap.models.gpt import GPTConfig

    vocab = 8192
    # 12·d² per block plus the embedding v·d: the positive root, rounded to heads of 64
    d = (-vocab + (vocab ** 2 + 48 * layers * params) ** 0.5) / (24 * layers)
    d = max(64, int(round(d / 64)) * 64)
    return GPTConfig(vocab_size=vocab, block_size=128, n_layer=layers, n_head=d // 64, n_embd=d)

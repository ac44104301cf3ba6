"""The memory prediction from the unwrapped model (`overlap.plan.memory_prediction`) against
torch's MemTracker on 2-rank `ShardedModule` runs, category by category."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from overlap.base.layout import FlatLayout, group_by_kind
from overlap.plan.memory import ActivationShape
from overlap.plan.memory_prediction import PREDICTED_CATEGORIES, predict_memory
from overlap.models import GPT, Block, GPTConfig
from distributed import run_distributed  # tests/ is on sys.path under pytest
from models import language_model_step

CONFIG = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 4
# (param dtype, optimizer, prefetch depth, bucket MB). A Block is 0.76 MiB in fp32: 1.6 MiB
# buckets hold two. The first case peaks in a unit's backward, the second at the loss.
CASES = [
    (None, "adamw", 1, None),
    (torch.bfloat16, "sgd-momentum", 2, None),
    (torch.bfloat16, "adamw", 1, 1.6),
]
# Relative tolerance per category, the same in docs/memory.md and the held-out cases
# (tests/test_memory_prediction_heldout.py): model states and gathered buffers follow from the
# layout and must match to the byte; activations leave out the layer norms' statistics.
TOLERANCE = {"weights": 0.0, "gradients": 0.0, "optimizer_state": 0.0, "gathered_buffers": 0.0,
             "activations": 0.01, "temporaries": 0.02}


def _shape() -> ActivationShape:
    config = GPTConfig(**CONFIG)
    return ActivationShape(batch=BATCH, seq=config.block_size, hidden=config.n_embd, layers=config.n_layer,
                           heads=config.n_head, vocab=config.vocab_size)


def _predict(param_dtype: Optional[torch.dtype], optimizer: str, depth: int, bucket_mb: Optional[float]):
    return predict_memory(GPT(GPTConfig(**CONFIG)), 2, unit_types=Block, bucket_mb=bucket_mb, prefetch_depth=depth,
                          param_dtype=param_dtype, optimizer=optimizer, activations=_shape())


def _measure_cases(rank: int, world_size: int) -> list:
    from overlap import MixedPrecision, ShardedModule
    from overlap.observe.memory import measure

    config = GPTConfig(**CONFIG)
    idx = torch.randint(0, config.vocab_size, (BATCH, config.block_size), generator=torch.Generator().manual_seed(0))
    measured = []
    for param_dtype, optimizer_name, depth, bucket_mb in CASES:
        torch.manual_seed(0)
        # A bucket below any unit merges nothing; the prediction's None means the same.
        model = ShardedModule(GPT(config), unit_types=[Block], bucket_mb=bucket_mb or 1e-6, prefetch_depth=depth,
                              mixed_precision=MixedPrecision(param_dtype=param_dtype))
        optimizer, step = language_model_step(model, optimizer_name, idx)
        measured.append(measure(model, optimizer, step))
    return measured


@pytest.mark.timeout(180)
def test_prediction_matches_tracker_per_category_on_two_ranks():
    measured = run_distributed(_measure_cases, 2, env={"OMP_NUM_THREADS": "1"}, timeout=150)[0]
    for case, result in zip(CASES, measured):
        predicted = _predict(*case)
        for category in PREDICTED_CATEGORIES:
            estimate, actual = getattr(predicted, category), getattr(result, category)
            print(f"{case} {category}: predicted {estimate / 1e6:.4f} MB, measured {actual / 1e6:.4f} MB, "
                  f"ratio {actual / estimate:.3f}")
            assert actual == pytest.approx(estimate, rel=TOLERANCE[category], abs=0), (case, category)


def test_settings_move_the_prediction_as_the_layout_does():
    plain, bucketed = _predict(*CASES[0]), _predict(None, "adamw", 1, 1.6)
    deeper = _predict(None, "adamw", 2, None)
    # Two-block buckets: two buckets in flight instead of two blocks, the root unchanged.
    block = (plain.gathered_buffers - _predict(None, "adamw", 0, None).gathered_buffers)
    # (to within the row-alignment padding, which differs between a two-block bucket and two blocks)
    assert bucketed.gathered_buffers == pytest.approx(plain.gathered_buffers + 2 * block, rel=1e-3)
    assert deeper.gathered_buffers == pytest.approx(plain.gathered_buffers + block)
    half = _predict(torch.bfloat16, "adamw", 1, None)
    assert half.weights == plain.weights and half.optimizer_state == plain.optimizer_state
    assert half.gathered_buffers == pytest.approx(plain.gathered_buffers / 2)
    assert _predict(None, "sgd", 1, None).optimizer_state == 0


def test_shards_are_padded_to_the_world_size():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))  # units of 12 and 8 parameters
    predicted = predict_memory(model, 3, optimizer="sgd-momentum")
    # Shard boundaries fall on rows (overlap.base.layout). 12 -> 6 per rank: the 3x3 weight is
    # longer than a shard, so a shard is whole rows of 3, and 4 per rank would cut a row;
    # ranks keep 6, 6 (two rows; a row and the bias) and 0 elements. 8 -> 3 per rank (padded
    # to 9): rows of the 2x3 weight on ranks 0 and 1, the bias on rank 2. fp32.
    assert predicted.weights == (6 + 3) * 4
    assert predicted.optimizer_state == (6 + 3) * 4
    assert predicted.gathered_buffers == (18 + 9) * 4   # depth 1: both units at once
    assert predicted.activations is None and predicted.temporaries is None


def test_flat_layout_gives_every_element_to_exactly_one_rank():
    """The layout both the runtime and the prediction use: parts of each parameter on the
    ranks tile it in order, and the padding is what is left of the last shard."""
    layout = FlatLayout((5, 0, 7, 1), world=3)      # 13 elements -> 5 per rank, 2 of padding
    assert layout.offsets == (0, 5, 5, 12) and layout.shard_numel == 5 and layout.padded_numel == 15
    assert layout.split_sizes == [5, 0, 0, 0, 7, 0, 1, 2]      # each parameter, then the padding after it
    for index, numel in enumerate(layout.numels):
        parts = [layout.part_on(index, rank) for rank in range(3)]
        assert sum(end - start for start, end in parts) == numel
        covered = [i for start, end in parts for i in range(start, end)]
        assert covered == list(range(numel)), (index, parts)
    assert [layout.held_numel(rank) for rank in range(3)] == [5, 5, 3]
    assert FlatLayout((), world=4).shard_numel == 1      # every rank holds a shard, even of nothing


def test_groups_follow_dtype_and_gradient_flag_in_order_of_appearance():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)),
              torch.nn.Parameter(torch.zeros(3), requires_grad=False), torch.nn.Parameter(torch.zeros(1))]
    groups = group_by_kind(params, lambda p: p)
    assert list(groups) == [(torch.float32, True), (torch.float16, True), (torch.float32, False)]
    assert [p.numel() for p in groups[(torch.float32, True)]] == [2, 1]


@pytest.mark.parametrize("kwargs, named", [
    (dict(world=0), "world=0"), (dict(prefetch_depth=-1), "prefetch_depth=-1"), (dict(optimizer="lion"), "lion")])
def test_bad_settings_are_named(kwargs, named):
    arguments = dict(world=2, **kwargs) if "world" not in kwargs else kwargs
    world = arguments.pop("world")
    with pytest.raises(ValueError, match=named):
        predict_memory(torch.nn.Linear(2, 2), world, **arguments)

"""ZeRO-3 over dp of a model split by torch's tensor parallelism over tp (the FSDP2 + TP
pattern: `parallelize_module(model, mesh["tp"], plan)`, then `ShardedModule(model,
mesh=mesh["dp"])`) equals one process on the same global batches, at (dp, tp) = (2, 2) and
(1, 2), with SGD and with AdamW under torch's clip_grad_norm_; what is not supported is
refused at wrap on every rank, naming it."""
from __future__ import annotations

import pytest
import torch

import tensor_parallel_cases as tp_cases
from overlap.base.mixed_precision import MixedPrecision
from distributed import CaseLaunch, RankCase

# (name, dp, optimizer, how) at each world size; tp = world // dp.
RUNS = {4: [("sgd", 2, "sgd", {}), ("adamw_clip", 2, "adamw", {"clip": tp_cases.CLIP}),
            ("bf16", 2, "sgd", {"wrap": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32)}}),
            ("no_sync", 2, "sgd", {"micro": 2}), ("checkpointed", 2, "adamw", {"checkpointed": True})],
        2: [("sgd", 1, "sgd", {}), ("adamw_clip", 1, "adamw", {"clip": tp_cases.CLIP})]}
TOL = {"rtol": 1e-4, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-3}
# What is refused, and what the error names.
REFUSED = {"compile": "compile=True", "compression": "compression='int8'", "offload": "offload='cpu'",
           "hpz": "sharding='hpz'", "no_mesh": "mesh=mesh['dp']", "hybrid": "hybrid sharding over a 2-D mesh",
           "optimizer_before_wrapping": "build the optimizer from model.parameters() after wrapping",
           "full_state_dict": "full values of tensor-parallel parameters"}

LAUNCHES = {world: CaseLaunch({**{name: RankCase(tp_cases.train_2d, (dp, optimizer, how, how.get("wrap", {})))
                                  for name, dp, optimizer, how in runs},
                               **({what: RankCase(tp_cases.refused, (what,)) for what in REFUSED} if world == 4 else {})},
                              world, timeout=300)
            for world, runs in RUNS.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,run", [(world, index) for world, runs in RUNS.items() for index in range(len(runs))],
                         ids=[f"dp{dp}-tp{world // dp}-{name}" for world, runs in RUNS.items()
                              for name, dp, _, _ in runs])
def test_2d_training_equals_one_process(world: int, run: int) -> None:
    name, _, optimizer, how = RUNS[world][run]
    ref = tp_cases.reference(optimizer, how)
    results = [outcome.result() for outcome in LAUNCHES[world][name]]
    tol = BF16_TOL if "wrap" in how else TOL
    for result in results:
        assert result["tp_split"] == 6 * tp_cases.SMALL_GPT.n_layer     # every block's weights and column biases
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result["losses"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), **tol)
        if "clip" in how:
            assert min(ref["norms"]) > how["clip"], ref["norms"]          # the clip scales every step
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), **tol)
    state = tp_cases.assemble([result["blocks"] for result in results])
    assert state.keys() == ref["state"].keys()
    for key, expected in ref["state"].items():
        torch.testing.assert_close(state[key].view(expected.shape), expected, **tol, msg=lambda m: f"{key}: {m}")
    assert ref["losses"][-1] < ref["losses"][0]                    # training moved


@pytest.mark.timeout(400)
@pytest.mark.parametrize("what", list(REFUSED))
def test_what_is_not_supported_is_refused_on_every_rank(what: str) -> None:
    for outcome in LAUNCHES[4][what]:
        assert REFUSED[what] in outcome.error(), outcome.error()

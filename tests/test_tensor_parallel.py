"""ZeRO-3 over dp of a model split by torch's tensor parallelism over tp (the FSDP2 + TP
pattern: `parallelize_module(model, mesh["tp"], plan)`, then `ShardedModule(model,
mesh=mesh["dp"])`) equals one process on the same global batches, at (dp, tp) = (2, 2) and
(1, 2), with SGD and with AdamW under torch's clip_grad_norm_; what is not supported is
refused at wrap on every rank, naming it."""
from __future__ import annotations

import pytest
import torch

import tensor_parallel_cases as tp_cases
from distributed import CaseLaunch, RankCase

# (name, dp, optimizer, clip) at each world size; tp = world // dp.
RUNS = {4: [("sgd", 2, "sgd", None), ("adamw_clip", 2, "adamw", tp_cases.CLIP)],
        2: [("sgd", 1, "sgd", None), ("adamw_clip", 1, "adamw", tp_cases.CLIP)]}
TOL = {"sgd": {"rtol": 1e-4, "atol": 1e-5}, "adamw": {"rtol": 1e-4, "atol": 1e-5}}

LAUNCHES = {world: CaseLaunch({name: RankCase(tp_cases.train_2d, (dp, optimizer, clip, {}))
                               for name, dp, optimizer, clip in runs}, world, timeout=300)
            for world, runs in RUNS.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,run", [(world, index) for world, runs in RUNS.items() for index in range(len(runs))],
                         ids=[f"dp{dp}-tp{world // dp}-{name}" for world, runs in RUNS.items()
                              for name, dp, _, _ in runs])
def test_2d_training_equals_one_process(world: int, run: int) -> None:
    name, _, optimizer, clip = RUNS[world][run]
    ref = tp_cases.reference(optimizer, clip)
    results = [outcome.result() for outcome in LAUNCHES[world][name]]
    tol = TOL[optimizer]
    for result in results:
        assert result["tp_split"] == 6 * tp_cases.SMALL_GPT.n_layer     # every block's weights and column biases
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result["losses"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), **tol)
        if clip is not None:
            assert min(ref["norms"]) > clip, ref["norms"]          # the clip scales every step
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), **tol)
    state = tp_cases.assemble([result["blocks"] for result in results])
    assert state.keys() == ref["state"].keys()
    for key, expected in ref["state"].items():
        torch.testing.assert_close(state[key].view(expected.shape), expected, **tol, msg=lambda m: f"{key}: {m}")
    assert ref["losses"][-1] < ref["losses"][0]                    # training moved

"""ZeRO-3 over dp of a model split by torch's tensor parallelism over tp (the FSDP2 + TP
pattern: `parallelize_module(model, mesh["tp"], plan)`, then `ShardedModule(model,
mesh=mesh["dp"])`) equals one process on the same global batches, at (dp, tp) = (2, 2) and
(1, 2), with SGD and with AdamW under torch's clip_grad_norm_; what is not supported is
refused at wrap on every rank, naming it."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import tensor_parallel_cases as tp_cases
from overlap.base.mixed_precision import MixedPrecision
from distributed import CaseLaunch, RankCase

# (name, dp, optimizer, how) at each world size; tp = world // dp.
RUNS = {4: [("sgd", 2, "sgd", {}), ("adamw_clip", 2, "adamw", {"clip": tp_cases.CLIP}),
            ("bf16", 2, "sgd", {"wrap": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32)}}),
            ("no_sync", 2, "sgd", {"micro": 2}),
            ("llama_adamw_clip", 2, "adamw", {"model": "llama", "clip": tp_cases.CLIP}),
            ("hybrid_adamw_clip", 2, "adamw", {"hybrid": True, "clip": tp_cases.CLIP}),
            ("module_clip", 2, "sgd", {"clip": tp_cases.CLIP, "module_clip": True}),
            ("offload_cpu", 2, "adamw", {"wrap": {"offload": "cpu"}}),
            ("checkpointed", 2, "adamw", {"checkpointed": True})],
        2: [("sgd", 1, "sgd", {}), ("adamw_clip", 1, "adamw", {"clip": tp_cases.CLIP}),
            ("llama_sgd", 1, "sgd", {"model": "llama"})]}
# Every rank compiles every block: about 40 s of four ranks on two cores, so it runs on a launch
# of its own in the slow tier (`make test-all`).
COMPILED = ("compiled", 2, "sgd", {"wrap": {"compile": True}})
TOL = {"rtol": 1e-4, "atol": 1e-5}
# Compression over dp, within tests/test_compression.py's bounds for SGD: each step's loss
# within 1 % of one process's, the whole update within 20 %.
COMPRESSED = ("int8", "int8-int4")
LOSS_RTOL, UPDATE_RTOL = 0.01, 0.2
BF16_TOL = {"rtol": 3e-2, "atol": 3e-3}
# What is refused, and what the error names.
REFUSED = {"offload_disk": "offload='disk'",
           "hpz": "sharding='hpz'", "no_mesh": "mesh=mesh['dp']", "sharding_hybrid": "sharding='hybrid'",
           "tp_mesh_as_dp": "must be two dimensions of one mesh", "meta": "is on the meta device",
           "replicas_outside_the_plane": "must be two dimensions of one mesh",
           "optimizer_before_wrapping": "build the optimizer from model.parameters() after wrapping"}

CHECKPOINT = os.path.join(tempfile.mkdtemp(), "step2")
FSDP2_CHECKPOINT = os.path.join(tempfile.mkdtemp(), "fsdp2_tp_step2")
SAVED_STEPS = 2
# (name, world, dp, split over tp) of each resume from the checkpoint saved at (2, 2).
RESUMES = [("resume_dp2_tp2", 4, 2, True), ("resume_dp1_tp2", 2, 1, True), ("resume_1d_dp2", 2, 2, False)]


def _training(dp: int, optimizer: str, how: dict) -> RankCase:
    return RankCase(tp_cases.train_2d, (dp, optimizer, how, how.get("wrap", {})))


def _cases(world: int) -> dict[str, RankCase]:
    cases = {name: _training(dp, optimizer, how) for name, dp, optimizer, how in RUNS[world]}
    if world == 4:
        cases.update({what: RankCase(tp_cases.refused, (what,)) for what in REFUSED})
        cases.update({mode: RankCase(tp_cases.train_2d, (2, "sgd", {}, {"compression": mode})) for mode in COMPRESSED})
        cases["save"] = RankCase(tp_cases.save_after, (CHECKPOINT, 2, SAVED_STEPS))
        cases["full_state"] = RankCase(tp_cases.full_state_round_trip, (2, SAVED_STEPS))
        cases["fsdp2_save"] = RankCase(tp_cases.fsdp2_saves, (FSDP2_CHECKPOINT, 2, SAVED_STEPS))
        cases["fsdp2_loads_ours"] = RankCase(tp_cases.fsdp2_resumes, (CHECKPOINT, 2, SAVED_STEPS))
        cases["ours_loads_fsdp2"] = RankCase(tp_cases.resume, (FSDP2_CHECKPOINT, 2, True, SAVED_STEPS))
    cases.update({name: RankCase(tp_cases.resume, (CHECKPOINT, dp, split, SAVED_STEPS))
                  for name, at, dp, split in RESUMES if at == world})
    return cases


LAUNCHES = {4: CaseLaunch(_cases(4), 4, timeout=300)}
LAUNCHES[2] = CaseLaunch(_cases(2), 2, timeout=300, after=[LAUNCHES[4]])
COMPILED_LAUNCH = CaseLaunch({COMPILED[0]: _training(*COMPILED[1:])}, 4, timeout=300)


def _training_runs() -> list:
    runs = [pytest.param(LAUNCHES[world], run, id=f"dp{run[1]}-tp{world // run[1]}-{run[0]}")
            for world, world_runs in RUNS.items() for run in world_runs]
    return runs + [pytest.param(COMPILED_LAUNCH, COMPILED, id="dp2-tp2-compiled", marks=pytest.mark.slow)]


def _assert_state_equal(results: list[dict], expected: dict[str, torch.Tensor], tol: dict) -> None:
    state = tp_cases.assemble([result["blocks"] for result in results])
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key].view(value.shape), value, **tol, msg=lambda m: f"{key}: {m}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launch,run", _training_runs())
def test_2d_training_equals_one_process(launch: CaseLaunch, run: tuple) -> None:
    name, _, optimizer, how = run
    ref = tp_cases.reference(optimizer, how)
    results = [outcome.result() for outcome in launch[name]]
    tol = BF16_TOL if "mixed_precision" in how.get("wrap", {}) else TOL
    for result in results:
        if "compile" in how.get("wrap", {}):
            assert result["graphs_compiled"] > 0
        if how.get("hybrid"):
            assert result["sharding"] == "hybrid sharding: 1 ranks per shard group, 2 replicas"
        if how.get("model") == "llama":
            assert result["tp_split"] == 7 * 2                          # every projection of both layers
        else:
            assert result["tp_split"] == 6 * tp_cases.SMALL_GPT.n_layer  # every block's weights and column biases
            assert result["parameter_count"] == tp_cases.SMALL_GPT.num_params
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result["losses"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), **tol)
        if "clip" in how:
            assert min(ref["norms"]) > how["clip"], ref["norms"]          # the clip scales every step
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), **tol)
    _assert_state_equal(results, ref["state"], tol)
    for result in results:           # the whole values, from the runtime and from torch's state-dict API
        for full in (result["full"], result["api_full"]):
            assert full.keys() == ref["state"].keys()
            for key, value in ref["state"].items():
                torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{key}: {m}")
    assert ref["losses"][-1] < ref["losses"][0]                    # training moved


@pytest.mark.timeout(400)
@pytest.mark.parametrize("what", list(REFUSED))
def test_what_is_not_supported_is_refused_on_every_rank(what: str) -> None:
    for outcome in LAUNCHES[4][what]:
        assert REFUSED[what] in outcome.error(), outcome.error()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,world", [(name, world) for name, world, _, _ in RESUMES])
def test_a_2d_checkpoint_resumes_at_another_shape(name: str, world: int) -> None:
    """Saved after 2 AdamW steps at (2, 2) (DCP: model and optimizer), loaded at (2, 2), (1, 2)
    and 1-D over 2 ranks: the third step is one process's third step (the optimizer state
    came back too: a fresh AdamW would take another step)."""
    assert all(outcome.ok for outcome in LAUNCHES[4]["save"]), [o.value for o in LAUNCHES[4]["save"]]
    ref = tp_cases.reference("adamw", {})
    results = [outcome.result() for outcome in LAUNCHES[world][name]]
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"][SAVED_STEPS:]), **TOL)
    _assert_state_equal(results, ref["state"], TOL)


@pytest.mark.timeout(400)
def test_whole_state_gathers_and_loads_at_2d() -> None:
    """At (2, 2), after 2 AdamW steps: the sharded state dict's values work as DTensors
    (`full_tensor`, `redistribute` to `Replicate`, elementwise operators); the whole model and
    optimizer state, from the runtime (`full_state_dict`, `full_optim_state_dict`) and from
    torch's API (`full_state_dict=True`), equal one process's; loaded into a new model and optimizer (the runtime's loads at the
    same layout, or torch's `set_model_state_dict` broadcast from rank 0 and
    `set_optimizer_state_dict` into 2 replicas of one shard offloaded to the host), each takes
    one process's third step (a fresh AdamW state would take another)."""
    ref = tp_cases.reference("adamw", {})
    after = tp_cases.reference("adamw", {}, steps=SAVED_STEPS)
    results = [outcome.result() for outcome in LAUNCHES[4]["full_state"]]
    for result in results:
        assert len(result["as_dtensors"]) == len(after["state"])      # every parameter's value is a DTensor
        wrong = {key: checks for key, checks in result["as_dtensors"].items() if not all(checks)}
        assert not wrong, f"full_tensor, redistribute to Replicate, elementwise: {wrong}"
        for source in ("ours", "torch"):
            model, optimizer = result["model"][source], result["optimizer"][source]
            assert model.keys() == after["state"].keys()
            for key, value in after["state"].items():
                torch.testing.assert_close(model[key], value, **TOL, msg=lambda m: f"{source} {key}: {m}")
            assert optimizer.keys() == after["optimizer"].keys()
            for name, values in after["optimizer"].items():
                for key, value in values.items():
                    torch.testing.assert_close(optimizer[name][key], value, **TOL,
                                               msg=lambda m: f"{source} {name} {key}: {m}")
    for how in ("ours", "torch"):
        resumed = [result[f"resumed_{how}"] for result in results]
        for run in resumed:
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"][SAVED_STEPS:]), **TOL)
        _assert_state_equal(resumed, ref["state"], TOL)


@pytest.mark.timeout(400)
def test_checkpoints_interchange_with_fsdp2_and_tp() -> None:
    """torchtitan's layout both ways at (2, 2): FSDP2 + TP loads a checkpoint of ours and ours
    loads one of FSDP2 + TP (same plan), each then taking one process's third step."""
    ref = tp_cases.reference("adamw", {})
    assert all(outcome.ok for outcome in LAUNCHES[4]["fsdp2_save"]), [o.value for o in LAUNCHES[4]["fsdp2_save"]]
    theirs = [outcome.result() for outcome in LAUNCHES[4]["fsdp2_loads_ours"]]
    for result in theirs:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"][SAVED_STEPS:]), **TOL)
    for key, value in ref["state"].items():
        torch.testing.assert_close(theirs[0]["state"][key], value, **TOL, msg=lambda m: f"{key}: {m}")
    ours = [outcome.result() for outcome in LAUNCHES[4]["ours_loads_fsdp2"]]
    for result in ours:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"][SAVED_STEPS:]), **TOL)
    _assert_state_equal(ours, ref["state"], TOL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", COMPRESSED)
def test_compression_over_dp_stays_close(mode: str) -> None:
    ref = tp_cases.reference("sgd", {})
    results = [outcome.result() for outcome in LAUNCHES[4][mode]]
    losses, ref_losses = torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"])
    assert ((losses - ref_losses).abs() / ref_losses.abs()).max() <= LOSS_RTOL
    state, initial = tp_cases.assemble([result["blocks"] for result in results]), tp_cases.initial_state()
    delta_ref = torch.cat([(value - initial[key]).flatten() for key, value in ref["state"].items()])
    delta = torch.cat([(state[key].view(value.shape) - initial[key]).flatten() for key, value in ref["state"].items()])
    error = float((delta - delta_ref).norm() / delta_ref.norm())
    assert 0 < error <= UPDATE_RTOL, error          # 0: nothing was quantised

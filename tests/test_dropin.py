"""Scripts written for DDP, Hugging Face's no_trainer examples and torchtitan, run under DDP
and under ShardedModule with the one wrapping line changed (tests/dropin_scripts.py): the
losses and torch's clip norms equal DDP's, the checkpoints load in one process to DDP's
values, and the one thing that cannot work (a one-rank `torch.save` of the module's and the
optimizer's own state dicts) fails at the save, naming what to call instead."""
from __future__ import annotations

import math
import tempfile

import pytest
import torch

import dropin_scripts as scripts
from distributed import run_distributed

WORLD = 2
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _all_loops(rank: int, world: int, out_dir: str) -> dict:
    results = {}
    for name, loop, kwargs in [("nanogpt", scripts.nanogpt_loop, {"grad_clip": 0.4}),
                               ("hf", scripts.hf_no_trainer_loop, {}),
                               ("torchtitan", scripts.torchtitan_loop, {})]:
        results[name] = {wrap.__name__: loop(rank, wrap, out_dir, **kwargs) for wrap in (scripts.ddp, scripts.sharded)}
    results["edge"] = scripts.edge_cases(rank)
    return results


@pytest.fixture(scope="module")
def runs() -> tuple[list[dict], str]:
    out_dir = tempfile.mkdtemp()
    return run_distributed(_all_loops, WORLD, out_dir, timeout=300), out_dir


@pytest.mark.parametrize("loop", ["nanogpt", "hf", "torchtitan"])
def test_losses_and_clip_norms_equal_ddp(runs, loop) -> None:
    results, _ = runs
    for rank, result in enumerate(results):
        ddp, ours = result[loop]["ddp"], result[loop]["sharded"]
        assert scripts.finite(ours["losses"]) and scripts.finite(ours["norms"]), (rank, ours)
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ddp["norms"]), **TOL)


def test_the_clip_binds_and_the_losses_move(runs) -> None:
    """The comparisons above can tell: the clip scales every step (a per-rank norm would give
    another factor) and training changed the loss."""
    results, _ = runs
    for loop, clip in [("nanogpt", 0.4), ("hf", 0.5), ("torchtitan", 0.3)]:
        ddp = results[0][loop]["ddp"]
        assert min(ddp["norms"]) > clip, (loop, ddp["norms"])
    nanogpt = results[0]["nanogpt"]["ddp"]["losses"]
    assert nanogpt[-1] < nanogpt[0] - 0.1


def test_a_resume_that_loads_state_before_wrapping_equals_ddps(runs) -> None:
    """Optimizer state of the whole parameters, loaded before wrapping, is resharded: the
    resumed losses are DDP's (the first one alone would not tell: the update after it does)."""
    results, _ = runs
    for result in results:
        ours, ddp = result["nanogpt"]["sharded"]["resumed"], result["nanogpt"]["ddp"]["resumed"]
        assert len(ours) == 2 and scripts.finite(ours)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ddp), **TOL)


def test_evaluation_on_every_rank_equals_ddp(runs) -> None:
    results, _ = runs
    for result in results:
        torch.testing.assert_close(torch.tensor(result["nanogpt"]["sharded"]["evals"]),
                                   torch.tensor(result["nanogpt"]["ddp"]["evals"]), **TOL)


def test_a_one_rank_save_of_the_parts_fails_naming_the_full_state_calls_and_keeps_the_earlier_file(runs) -> None:
    results, _ = runs
    assert results[0]["nanogpt"]["ddp"]["save_error"] is None
    assert results[0]["nanogpt"]["ddp"]["earlier_file_kept"] is False          # DDP's save replaced it
    error = results[0]["nanogpt"]["sharded"]["save_error"]
    assert error is not None and error.startswith("PartialStateError"), error
    assert "model.full_state_dict(rank0_only=True)" in error and "model.module.state_dict()" in error
    assert results[0]["nanogpt"]["sharded"]["earlier_file_kept"] is True


def test_a_one_rank_save_of_the_optimizer_alone_fails_at_the_call_and_keeps_the_earlier_file(runs) -> None:
    results, _ = runs
    assert results[0]["nanogpt"]["ddp"]["optimizer_save_error"] is None
    assert results[0]["nanogpt"]["ddp"]["optimizer_file_kept"] is False        # DDP's save replaced it
    error = results[0]["nanogpt"]["sharded"]["optimizer_save_error"]
    assert error is not None and error.startswith("PartialStateError") and "did not call it" in error, error
    assert "full_optim_state_dict" in error
    assert results[0]["nanogpt"]["sharded"]["optimizer_file_kept"] is True


def test_parameter_count_is_this_ranks_part(runs) -> None:
    results, _ = runs
    whole = results[0]["nanogpt"]["ddp"]["counted"]
    parts = [result["nanogpt"]["sharded"]["counted"] for result in results]
    assert sum(parts) == whole and all(part < whole for part in parts)


def test_full_checkpoints_load_in_one_process_to_ddps_values(runs) -> None:
    results, out_dir = runs
    ddp = torch.load(results[0]["nanogpt"]["ddp"]["state"], weights_only=True)
    ours = torch.load(results[0]["nanogpt"]["sharded"]["state"], weights_only=True)
    plain = scripts.GPT(scripts.CONFIG)
    plain.load_state_dict(ours["model"])
    assert ours["model"].keys() == ddp["model"].keys()
    for key in ddp["model"]:
        torch.testing.assert_close(ours["model"][key], ddp["model"][key], **TOL)
    assert ours["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    for index, state in ddp["optimizer"]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(ours["optimizer"]["state"][index][name], value, **TOL)
    optimizer = scripts.nanogpt_optimizer(plain)
    optimizer.load_state_dict(ours["optimizer"])
    torch.testing.assert_close(optimizer.state_dict()["state"][0]["exp_avg"], ddp["optimizer"]["state"][0]["exp_avg"],
                               **TOL)


def test_hf_save_pretrained_loads_to_ddps_values(runs) -> None:
    from transformers import GPT2LMHeadModel

    results, _ = runs
    ddp = GPT2LMHeadModel.from_pretrained(results[0]["hf"]["ddp"]["path"]).state_dict()
    for path in (results[0]["hf"]["sharded"]["path"], results[0]["hf"]["sharded"]["path"] + "_every_rank"):
        ours = GPT2LMHeadModel.from_pretrained(path).state_dict()
        for key in ddp:
            torch.testing.assert_close(ours[key], ddp[key], **TOL)


def test_dcp_checkpoints_load_in_one_process_to_ddps_values(runs) -> None:
    import torch.distributed.checkpoint as dcp

    results, _ = runs
    values = []
    for wrap in ("ddp", "sharded"):
        model = scripts.GPT(scripts.CONFIG)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=results[0]["torchtitan"][wrap]["path"], no_dist=True)
        values.append(state["model"])
    for key in values[0]:
        torch.testing.assert_close(values[1][key], values[0][key], **TOL)


def _edge(runs, name: str) -> list:
    results, _ = runs
    return [result["edge"][name] for result in results]


def test_a_parameter_that_could_not_be_kept_is_refused_at_the_step(runs) -> None:
    for status, value in _edge(runs, "weakref"):
        assert status == "error" and "'wpe.weight'" in value and "after wrapping" in value, value


def test_optimizer_state_of_another_shape_is_refused_naming_it(runs) -> None:
    for status, value in _edge(runs, "other_shape"):
        assert status == "error" and value.startswith("ValueError") and "'wpe.weight'" in value, value


def test_fsdp2s_switch_accumulates_as_no_sync(runs) -> None:
    for status, value in _edge(runs, "switches"):
        assert status == "ok" and value[0] > 0, value


def test_grad_norms_are_the_whole_parameters(runs) -> None:
    for (status, ours), (_, ddp) in zip(_edge(runs, "grad_norms"), _edge(runs, "grad_norms_ddp")):
        assert status == "ok", ours
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ddp), **TOL)


def test_the_modules_part_is_refused_at_the_call_and_the_optimizers_refuses_torch_save(runs) -> None:
    for status, value in _edge(runs, "sharded_state"):
        assert status == "ok", value
        assert value["module"].startswith("PartialStateError") and "full_state_dict(rank0_only=True)" in value["module"]
        assert value["deepcopy"]
        for name in ("optimizer", "snapshot"):
            assert value[name].startswith("PartialStateError") and "full_optim_state_dict" in value[name], value


def test_a_loss_computed_from_the_parameters_is_refused_on_every_rank_in_every_mode(runs) -> None:
    """DDP trains an L2 term over model.parameters(); under ZeRO-3 each rank holds rows only,
    so the backward refuses by name instead of training on this rank's rows."""
    for status, value in _edge(runs, "l2_penalty"):
        assert status == "ok", value
        for mode in ("full", "offload_cpu_bf16", "int8", "hybrid"):
            outcome, message = value[mode]
            assert outcome == "error" and message.startswith("DirectGradientError") and "weight_decay" in message, \
                (mode, value[mode])
            assert value[mode + " then"], mode


def test_a_switch_that_is_not_a_bool_is_refused(runs) -> None:
    for status, value in _edge(runs, "bad_switch"):
        assert status == "error" and "require_backward_grad_sync" in value, value


def test_torchs_clip_equals_the_runtimes_in_every_mode(runs) -> None:
    for status, norms in _edge(runs, "clip_modes"):
        assert status == "ok", norms
        for mode, (theirs, ours) in norms.items():
            assert math.isfinite(theirs) and theirs > 0, (mode, norms)
            assert math.isclose(theirs, ours, rel_tol=1e-5), (mode, norms)
        for lossless in ("full", "offload_cpu", "hybrid", "hpz"):
            assert math.isclose(norms[lossless][0], norms["ddp"][0], rel_tol=1e-5), (lossless, norms)


def _evaluate_on_rank0_then_train(rank: int, world: int) -> str:
    from overlap.runtime import order_check

    order_check.CHECK_AFTER_S = 1.0              # compare the ranks' units after 1 s blocked, not 10
    model = scripts.sharded(scripts.GPT(scripts.CONFIG))
    try:
        if rank == 0:
            model.eval()
            with torch.no_grad():
                model(*scripts._batch(9, 0, rank, scripts.CONFIG.vocab_size))
            model.train()
        model(*scripts._batch(0, 0, rank, scripts.CONFIG.vocab_size)).backward()
    except Exception as exc:  # noqa: BLE001 - the error each rank raised is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_an_evaluation_on_rank0_alone_names_the_likely_cause_on_every_rank() -> None:
    errors = run_distributed(_evaluate_on_rank0_then_train, WORLD, timeout=180)
    for error in errors:
        assert error.startswith("DivergenceError"), error
        assert "forward run on some ranks only" in error and "full_state_dict(rank0_only=True)" in error, error

"""Expert parallelism under ZeRO-3 (`ShardedModule(model, expert_parallel=E)`) against one
process training the whole model on the global batch with DDP's semantics (the mean of every
rank's loss): the GPT-MoE of overlap.models.moe and Hugging Face's Qwen3-MoE, routing as the
router chooses and skewed (experts and whole ranks that receive no token), SGD and AdamW,
torch's clip over all experts; the full state dict gathers every expert."""
from __future__ import annotations

import pytest
import torch

from distributed import CaseLaunch, RankCase

PER_RANK, SEQ, STEPS, VOCAB = 2, 8, 3, 64
# Router logits added by a forward hook: "skewed" sends every token to experts 0 and 1 (the
# first expert-parallel rank's at E = 2; ranks 2 and 3 get none at E = 4).
SKEW = {"normal": None, "skewed": (20.0, 10.0, -10.0, -10.0)}


def _gpt_moe() -> torch.nn.Module:
    from overlap.models.moe import GPTMoE, MoEConfig
    torch.manual_seed(0)
    return GPTMoE(MoEConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, n_expert=4,
                            top_k=2, expert_hidden=8))


def _qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                            output_router_logits=True, router_aux_loss_coef=0.01, max_position_embeddings=SEQ)
    return Qwen3MoeForCausalLM(config)


MODELS = {"gpt_moe": _gpt_moe, "qwen3_moe": _qwen3_moe}


def _skew(model: torch.nn.Module, routing: str) -> None:
    bias = SKEW[routing]
    if bias is None:
        return
    for name, module in model.named_modules():
        if name.endswith("router"):
            module.register_forward_hook(lambda m, args, out: out + torch.tensor(bias, dtype=out.dtype))


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "qwen3_moe":
        return model(input_ids=x, labels=y).loss
    return model(x, y)


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=gen),
             torch.randint(0, VOCAB, (PER_RANK * world, SEQ), generator=gen)) for _ in range(STEPS)]


def _optimizer(params, name: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def one_process(world: int, kind: str, routing: str, optimizer: str, clip: float) -> dict:
    model = MODELS[kind]()
    _skew(model, routing)
    opt = _optimizer(model.parameters(), optimizer)
    losses, norms = [], []
    for x, y in _batches(world):
        per_rank = [_loss(model, x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK], kind)
                    for r in range(world)]
        loss = sum(per_rank) / world
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(rank: int, world: int, kind: str, expert_parallel: int, routing: str, optimizer: str,
          clip: float) -> dict:
    import torch.distributed as dist

    from overlap import ShardedModule

    model = MODELS[kind]()
    _skew(model, routing)
    opt = _optimizer(model.parameters(), optimizer)           # built before wrapping, as users do
    model = ShardedModule(model, expert_parallel=expert_parallel)
    losses, norms = [], []
    for x, y in _batches(world):
        loss = _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK], kind)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return {"losses": losses, "norms": norms, "state": model.full_state_dict(rank0_only=True)}


def reshard(rank: int, world: int) -> dict:
    """A full state saved at E = 2 after a step loads at E = 4 and without expert parallelism,
    each giving back the same values."""
    from overlap import ShardedModule

    model = ShardedModule(_gpt_moe(), expert_parallel=2)
    optimizer = _optimizer(model.parameters(), "sgd")
    x, y = _batches(world)[0]
    _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK],
          "gpt_moe").backward()
    optimizer.step()
    saved = model.full_state_dict()
    out = {}
    for ep in (4, None):
        other = ShardedModule(_gpt_moe(), expert_parallel=ep)
        other.load_full_state_dict(saved)
        back = other.full_state_dict()
        out[ep] = max(float((back[key] - value).abs().max()) for key, value in saved.items())
    out["moved"] = max(float((saved[key] - value).abs().max()) for key, value in _gpt_moe().state_dict().items())
    return out


def refusals(rank: int, world: int) -> dict:
    from torch import nn

    from overlap import ShardedModule

    out = {}
    for name, make in (("offload", lambda: ShardedModule(_gpt_moe(), expert_parallel=2, offload="cpu")),
                       ("no_experts", lambda: ShardedModule(nn.Sequential(nn.Linear(4, 4)), expert_parallel=2)),
                       ("indivisible", lambda: ShardedModule(_gpt_moe(), expert_parallel=3)),
                       ("state_dict", lambda: ShardedModule(_gpt_moe(), expert_parallel=2).state_dict())):
        try:
            make()
            out[name] = "returned"
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def diverge(rank: int, world: int) -> str:
    """Rank 1 skips a MoE layer in the second step: a named error on every rank, not a hang."""
    from overlap import ShardedModule

    model = ShardedModule(_gpt_moe(), expert_parallel=2)
    for step, (x, y) in enumerate(_batches(world)[:2]):
        if step == 1 and rank == 1:
            model.module.blocks = type(model.module.blocks)(list(model.module.blocks)[:1])
        _loss(model, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK],
              "gpt_moe").backward()
    return "returned"


# (world, kind, expert_parallel, routing, optimizer, clip)
CASES = {
    "w2-ep2-normal-adamw-clip": (2, "gpt_moe", 2, "normal", "adamw", 0.05),
    "w2-ep2-skewed-sgd": (2, "gpt_moe", 2, "skewed", "sgd", 0.0),
    "w2-ep2-normal-sgd": (2, "gpt_moe", 2, "normal", "sgd", 0.0),
    "w2-ep2-qwen3-adamw": (2, "qwen3_moe", 2, "normal", "adamw", 0.0),
    "w4-ep2-normal-sgd-clip": (4, "gpt_moe", 2, "normal", "sgd", 0.05),
    "w4-ep4-skewed-adamw": (4, "gpt_moe", 4, "skewed", "adamw", 0.0),
    "w4-ep4-normal-sgd": (4, "gpt_moe", 4, "normal", "sgd", 0.0),
}


@pytest.fixture(scope="module")
def launches() -> dict[int, CaseLaunch]:
    out = {}
    for world in (2, 4):
        cases = {name: RankCase(train, (kind, ep, routing, opt, clip))
                 for name, (w, kind, ep, routing, opt, clip) in CASES.items() if w == world}
        if world == 2:
            cases["refusals"] = RankCase(refusals)
            cases["diverge"] = RankCase(diverge)          # last: the ranks part
        if world == 4:
            cases["reshard"] = RankCase(reshard)
        out[world] = CaseLaunch(cases, world_size=world, timeout=300)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_trains_like_one_process(launches, case: str) -> None:
    world, kind, ep, routing, optimizer, clip = CASES[case]
    reference = one_process(world, kind, routing, optimizer, clip)
    outcomes = [outcome.result() for outcome in launches[world][case]]
    for result in outcomes:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        if clip:
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]),
                                       rtol=1e-5, atol=1e-6)
            assert min(reference["norms"]) > clip                  # the clip binds
    state = outcomes[0]["state"]
    assert set(state) == set(reference["state"])
    # AdamW divides by the gradient's own scale: where a gradient is near zero, summation
    # order's rounding moves its update by up to a few parts in a million of the learning rate.
    tol = {"rtol": 1e-5, "atol": 1e-6} if optimizer == "sgd" else {"rtol": 1e-4, "atol": 1e-5}
    for key, value in reference["state"].items():
        torch.testing.assert_close(state[key], value, **tol, msg=lambda m: f"{key}: {m}")
    assert reference["losses"][0] != reference["losses"][-1]      # training moved


@pytest.mark.timeout(600)
def test_what_does_not_compose_is_refused_on_every_rank(launches) -> None:
    for outcome in launches[2]["refusals"]:
        result = outcome.result()
        assert result["offload"].startswith("ValueError") and "offload='cpu'" in result["offload"], result
        assert "no expert module" in result["no_experts"], result
        assert "must divide the number of experts" in result["indivisible"] or \
            "must divide the world size" in result["indivisible"], result
        assert result["state_dict"].startswith("NotImplementedError"), result


@pytest.mark.timeout(600)
def test_a_full_state_saved_at_one_expert_parallel_size_loads_at_another(launches) -> None:
    for outcome in launches[4]["reshard"]:
        result = outcome.result()
        assert result[4] == 0.0 and result[None] == 0.0 and result["moved"] > 0, result


@pytest.mark.timeout(600)
def test_a_rank_that_skips_a_moe_layer_is_a_named_error_on_every_rank(launches) -> None:
    for outcome in launches[2]["diverge"]:
        error = outcome.error()
        assert error.startswith("DivergenceError") and "ran different units" in error, error

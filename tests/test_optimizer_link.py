"""The one object through which the runtime speaks to optimizers (`model.optimizer_link`,
overlap/runtime/optimizer_link.py): reachable from the model, linking any torch optimizer at
its first step whether built before or after wrapping, one optimizer over two models linked
to both, one process-wide hook however many models, a one-process state loaded later
resharded, and every runtime and link freed with its model and optimizers."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from distributed import run_distributed


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _links(rank: int, world: int) -> dict:
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from overlap import ShardedModule, fully_shard
    from overlap.runtime.optimizer_link import OptimizerLink

    hooks_before = len(_global_optimizer_pre_hooks)
    first = _net(0)
    before = torch.optim.AdamW(first.parameters(), lr=1e-2)      # built before wrapping
    first = ShardedModule(first)
    second = _net(1)
    fully_shard(second[0])
    fully_shard(second)
    x = torch.randn(4, 6)
    after = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1, momentum=0.9)
    links = [first.optimizer_link, second.overlap_runtime.optimizer_link]
    out = {"types": [type(link) is OptimizerLink for link in links], "distinct": links[0] is not links[1],
           "linked_before_step": [link.is_linked(opt) for link in links for opt in (before, after)]}
    for optimizer in (before, after):
        (first(x).square().mean() + second(x).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    out["linked_after_step"] = [link.is_linked(opt) for link in links for opt in (before, after)]
    out["hooks_added"] = len(_global_optimizer_pre_hooks) - hooks_before
    # A whole-shape state loaded into `after` (a one-process state dict) is resharded for both
    # models at its next step; any other shape is refused naming the parameter.
    after.load_state_dict(_whole(after, first, second))
    weight = next(first.parameters())
    out["resharded"] = tuple(after.state[weight]["momentum_buffer"].shape) == tuple(weight.shape)
    # Gone with the models and optimizers: no hook that autograd keeps in C++ holds a runtime.
    runtimes = [weakref.ref(obj) for obj in (first.scheduler, second.overlap_runtime.scheduler, *links)]
    del first, second, before, after, optimizer, links, weight
    gc.collect()
    out["freed"] = [ref() is None for ref in runtimes]
    return out


def _whole(optimizer: torch.optim.Optimizer, *models: nn.Module) -> dict:
    """`optimizer`'s state dict as one process would hold it: every state of a parameter's
    whole shape (zeros; what matters here is the shape)."""
    shapes = {}
    for model in models:
        layout = model.full_state_dict() if hasattr(model, "full_state_dict") else \
            {k: v.full_tensor() for k, v in model.state_dict().items()}
        shapes.update({id(p): layout[name].shape for name, p in model.named_parameters()})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    packed = {"state": {i: {"momentum_buffer": torch.zeros(shapes[id(p)])} for i, p in enumerate(params)},
              "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                "params": list(range(len(params)))} for g in optimizer.param_groups]}
    return packed


@pytest.mark.timeout(300)
def test_every_optimizer_is_linked_through_its_models_link() -> None:
    for result in run_distributed(_links, 2, timeout=240):
        assert result["types"] == [True, True] and result["distinct"], result
        assert result["linked_before_step"] == [False] * 4, result
        # `before` holds only the first model's parameters; `after` holds both models'.
        assert result["linked_after_step"] == [True, True, False, True], result
        assert result["hooks_added"] <= 1, result
        assert result["resharded"], result
        assert result["freed"] == [True] * 4, result

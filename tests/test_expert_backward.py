"""An expert call's backward split in two (overlap/runtime/expert_backward.py): the same
gradients as the module's own backward, the tokens' gradient handed on before the weights'
is made, both halves run apart as the zero-bubble schedules run them, and a second backward
refused by name."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from overlap.models.moe import Experts
from overlap.runtime.expert_backward import expert_call, splits_backward


class _Marked(torch.autograd.Function):
    """Identity; backward appends "tokens" to `events` (where the dispatcher sends)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, events: list) -> torch.Tensor:
        ctx.events = events
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.events.append("tokens")
        return grad, None


def _setup(tokens: int, seed: int = 0) -> tuple[Experts, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    module = Experts(4, 6, 5)
    hidden = torch.randn(tokens, 6, requires_grad=True)
    experts = torch.randint(0, 4, (tokens, 1))
    return module, hidden, experts, torch.rand(tokens, 1)


def _split_call(module: Experts, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                events: list) -> torch.Tensor:
    call = expert_call(module, type(module).forward, True)  # its weight node before the marked one
    return call(_Marked.apply(hidden, events), experts, weights)


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_gradients_match_the_modules_own_backward_and_the_tokens_go_first(tokens: int) -> None:
    module, hidden, experts, weights = _setup(tokens)
    grad_out = torch.randn(tokens, 6)
    expected_out = Experts.forward(module, hidden, experts, weights)
    expected = torch.autograd.grad(expected_out, [hidden, *module.parameters()], grad_out)

    events: list = []
    for param in module.parameters():
        param.register_hook(lambda grad: events.append("weights"))
    hidden.grad = None
    out = _split_call(module, hidden, experts, weights, events)
    out.backward(grad_out)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for got, want in zip([hidden.grad, *(param.grad for param in module.parameters())], expected):
        torch.testing.assert_close(got, want)
    assert events == ["tokens", "weights", "weights"], events


def test_an_empty_call_gives_zero_gradients_to_tokens_and_every_weight() -> None:
    module, hidden, experts, weights = _setup(0)
    out = _split_call(module, hidden, experts, weights, [])
    assert out.requires_grad and out.shape == (0, 6)
    (out.sum() + (hidden.sum() * 0)).backward()
    assert all(param.grad is not None and not param.grad.any() for param in module.parameters())


def test_the_input_and_weight_steps_run_apart_as_a_split_pipeline_backward_runs_them() -> None:
    module, hidden, experts, weights = _setup(9)
    grad_out = torch.randn(9, 6)
    expected = torch.autograd.grad(Experts.forward(module, hidden, experts, weights),
                                   [hidden, *module.parameters()], grad_out)
    events: list = []
    out = _split_call(module, hidden, experts, weights, events)
    (hidden_grad,) = torch.autograd.grad(out, hidden, grad_out, retain_graph=True)   # the input step
    assert events == ["tokens"]
    params = list(module.parameters())
    weight_grads = torch.autograd.grad(out, params, grad_out)                         # the weight step
    assert events == ["tokens"], "the weight step ran the tokens' node again"
    for got, want in zip([hidden_grad, *weight_grads], expected):
        torch.testing.assert_close(got, want)


def test_a_second_backward_is_refused_by_name() -> None:
    module, hidden, experts, weights = _setup(5)
    out = _split_call(module, hidden, experts, weights, [])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through one forward of Experts"):
        out.sum().backward()


def test_no_split_without_grad_or_under_saved_tensor_hooks() -> None:
    module, hidden, *_ = _setup(3)
    assert splits_backward(module, hidden)
    with torch.no_grad():
        assert not splits_backward(module, hidden)
    with torch.autograd.graph.save_on_cpu():
        assert not splits_backward(module, hidden)


def test_the_split_backward_costs_the_flops_of_the_modules_own() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    module, hidden, experts, weights = _setup(40)
    grad_out = torch.randn(40, 6)
    counted = []
    for split in (False, True):
        out = _split_call(module, hidden, experts, weights, []) if split else \
            Experts.forward(module, hidden, experts, weights)
        with FlopCounterMode(display=False) as counter:
            out.backward(grad_out)
        counted.append(counter.get_total_flops())
    assert counted[0] > 0 and counted[1] == counted[0], counted


class _TwiceAndChild(torch.nn.Module):
    """A weight used at two depths of the tokens' path (a join below another), and a child
    module's weight beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.square = torch.nn.Parameter(torch.randn(6, 6) / 3)
        self.child = torch.nn.Linear(6, 6)

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.child(hidden @ self.square @ self.square) * weights


def test_a_weight_used_twice_and_a_childs_weights_get_the_modules_own_gradients() -> None:
    torch.manual_seed(1)
    module = _TwiceAndChild()
    hidden = torch.randn(5, 6, requires_grad=True)
    experts, weights, grad_out = torch.zeros(5, 1, dtype=torch.long), torch.rand(5, 1), torch.randn(5, 6)
    expected = torch.autograd.grad(module(hidden, experts, weights), [hidden, *module.parameters()], grad_out)
    out = _split_call(module, hidden, experts, weights, [])
    out.backward(grad_out)
    for got, want in zip([hidden.grad, *(param.grad for param in module.parameters())], expected):
        torch.testing.assert_close(got, want)

"""An expert call whose backward is two autograd nodes: the tokens' gradient first, the
weights' after, so that the dispatcher sends the tokens' gradient before the weights' is made.

[Note: expert weight gradients after the send]
Autograd's matrix-multiply nodes make an input's and a weight's gradient in one call, so a
chunk's expert backward ends with both, and only then can its tokens' gradient travel. Here
the expert module's forward runs inside an input node on detached tokens and detached weights
(an inner graph the call keeps), and a weight node, made from the weights the module computes
with, feeds the input node a 0-d tap. Backward runs the input node (the inner graph's tokens'
gradient, the graph kept), then, most recently made first, the dispatcher's send-back node
made after the weight node (the tokens' gradient issued), then the weight node (the inner
graph's weights' gradient, the graph dropped). A chunk's weight gradients are then computed
while its tokens' gradient travels, as zero-bubble schedules split a backward in two
(DeepSeek's DualPipe does the same for its expert weights).

The weights' pass does not run the tokens' path again. The tokens' pass records the gradient
reaching each join, a node on the tokens' path with an edge to weights only (a weight's
matrix multiply); the weights' pass starts at the joins with those gradients, one
`autograd.grad` per set of weights the joins lead to, so that a join computes only its
weight's output and one set's per-expert pieces are not held beside another set's whole
gradient. Where that would count a gradient twice (a join below another on the tokens' path,
a weight used at two depths) the weights' pass starts from the output instead, running the
tokens' path again. The weights' pass costs the flops of the module's own backward, and the
inner graph it keeps from the tokens' pass adds a call's activations to the peak.

The inner graph is dropped by the last node that needs it, so a second backward through the
same forward is refused by name. A backward that reaches only one of the two nodes keeps the
graph for the other: the zero-bubble pipeline schedules' input step (`autograd.grad` over the
stage's input) runs the input node only, and their weight step runs the input node again,
which then skips the tokens' gradient its send-back node will not take
(`_will_engine_execute_node`), and the weight node. Every parameter of the module joins the
input's path at the input nodes only, one node per call holding all of them, which is the
shape torch's grouping for the weight step handles (see [Note: a backward split in two] in
overlap/runtime/expert_parallel.py).

A call made under saved-tensor hooks (non-reentrant activation checkpointing, `save_on_cpu`)
is not split: those hooks recompute or reload per backward pass, and the inner graph's own
backwards are passes of their own, which would recompute the whole block again for each.
Reentrant checkpointing recomputes without hooks, so its recompute is split.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

_ABSENT = object()


def splits_backward(module: nn.Module, tokens: torch.Tensor) -> bool:
    """Whether an expert call of `module` on `tokens` records a backward split in two (see the
    note): it records one, and no saved-tensor hooks are active."""
    if not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return False
    return tokens.requires_grad or any(param.requires_grad for param in module.parameters())


def expert_call(module: nn.Module, compute: Callable[..., torch.Tensor],
                split: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`compute(module, tokens, experts, weights)` as a call of (tokens, experts, weights): split
    in two (an `ExpertCall`, its weight node made now, before the caller's next node), or as it is."""
    if not split:
        return functools.partial(compute, module)
    call = ExpertCall(module, compute)
    call.weights_node()
    return call


class ExpertCall:
    """One call of an expert module's forward, `compute(module, tokens, experts, weights)`,
    with its backward split in two (see the note). `weights_node` makes the weight node (before
    the dispatcher's send-back node), the call itself the input node."""

    def __init__(self, module: nn.Module, compute: Callable[..., torch.Tensor]) -> None:
        self.module, self.compute = module, compute
        # Every parameter the forward reads, by the module that holds it: within the unit's
        # forward, the gathered views.
        self.owners = [(owner, name) for owner in module.modules() for name in owner._parameters
                       if isinstance(getattr(owner, name), torch.Tensor)]
        self.weights = [getattr(owner, name) for owner, name in self.owners]
        self.tap: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None
        self.leaves: list[torch.Tensor] = []
        self.out: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        # Set by the tokens' gradient when the weight node will follow: the joins (see `_joins`)
        # and the gradient each received; None, the weights' gradients come from the output.
        self.received: Optional[dict[Any, tuple]] = None
        self.joins: Optional[dict[frozenset[int], Optional[set[Any]]]] = {}

    def weights_node(self) -> None:
        """Make the weight node, whose 0-d tap the input node takes."""
        if any(weight.requires_grad for weight in self.weights):
            self.tap = _WeightNode.apply(self, *self.weights)

    def __call__(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # The tap leaves the call: through it the call would hold the weight node, which holds
        # the call, a cycle only the garbage collector frees.
        tap, self.tap = self.tap, None
        return _InputNode.apply(self, tokens, experts, weights, tap)

    def run(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The module's forward on detached tokens and weights, its graph kept."""
        self.tokens = tokens.detach().requires_grad_(tokens.requires_grad)
        self.leaves = [weight.detach().requires_grad_(weight.requires_grad) for weight in self.weights]
        self.weights = []
        # An instance attribute is found before the registered parameter.
        shadowed = [owner.__dict__.get(name, _ABSENT) for owner, name in self.owners]
        for (owner, name), leaf in zip(self.owners, self.leaves):
            owner.__dict__[name] = leaf
        try:
            with torch.enable_grad():
                self.out = self.compute(self.module, self.tokens, experts, weights)
        finally:
            for (owner, name), before in zip(self.owners, shadowed):
                if before is _ABSENT:
                    del owner.__dict__[name]
                else:
                    owner.__dict__[name] = before
        return self.out.detach()

    def _grads(self, roots: list[Any], grads: list[torch.Tensor], inputs: list[torch.Tensor],
               keep: bool) -> list[torch.Tensor]:
        if not self.out.requires_grad or not roots:     # no pair reached a weight (an empty call)
            return [torch.zeros_like(tensor) for tensor in inputs]
        return list(torch.autograd.grad(roots, inputs, grads, retain_graph=keep, allow_unused=True,
                                        materialize_grads=True))

    def input_grad(self, keep: bool) -> torch.Tensor:
        """The tokens' gradient; kept for the weight node, the gradient each join received."""
        if self.out is None:
            raise RuntimeError(f"a second backward through one forward of {type(self.module).__name__} under "
                               "expert parallelism: its expert calls keep their graph for one backward only")
        self.joins = self._joins() if keep and self.out.requires_grad else {}
        if self.joins is None:
            return self._grads([self.out], [self.grad], [self.tokens], keep)[0]
        nodes = {node for joins in self.joins.values() for node in joins or ()}
        self.received = {}
        handles = [node.register_prehook(functools.partial(_receive, self.received, node)) for node in nodes]
        try:
            (grad,) = self._grads([self.out], [self.grad], [self.tokens], keep)
        finally:
            for handle in handles:
                handle.remove()
        return grad

    def weight_grads(self) -> list[Optional[torch.Tensor]]:
        """The weights' gradients, one set of weights at a time: from the gradients that set's
        joins received, or from the output (the tokens' gradient was not made, or no join
        leads to them)."""
        wanted = [leaf for leaf in self.leaves if leaf.requires_grad]
        made: dict[int, torch.Tensor] = {}
        parts = [(frozenset(map(id, wanted)), None)] if self.received is None else self.joins.items()
        for reached, joins in parts:
            targets = [leaf for leaf in wanted if id(leaf) in reached]
            if joins is None:
                grads = self._grads([self.out], [self.grad], targets, keep=True)
            else:
                roots = [(GradientEdge(node, i), grad) for node in joins
                         for i, grad in enumerate(self.received.get(node, ())) if grad is not None]
                # The joins run for their weights' outputs only: their outputs towards the
                # tokens lead to none of these weights (see `_joins`).
                grads = self._grads([edge for edge, _ in roots], [grad for _, grad in roots], targets, keep=True)
            made.update(zip(map(id, targets), grads))
        out = [None if not leaf.requires_grad else made[id(leaf)] if id(leaf) in made else torch.zeros_like(leaf)
               for leaf in self.leaves]
        self.release()
        return out

    def _joins(self) -> Optional[dict[frozenset[int], Optional[set[Any]]]]:
        """The inner graph's nodes on the tokens' path with an edge that leads to weights only
        (the joins, where the weights' gradients part from the tokens'), by the set of weights
        those edges lead to, and the weights no join leads to (None: from the output). None
        where a weight's gradient would be counted twice from the joins: the weight is in two
        sets, or one join of a set lies below another on the tokens' path."""
        leaves = {id(leaf) for leaf in self.leaves if leaf.requires_grad}
        # node -> (whether it reaches the tokens, the weights it reaches)
        reached: dict[Any, tuple[bool, frozenset[int]]] = {}

        def reach(node: Any) -> tuple[bool, frozenset[int]]:
            if node not in reached:
                variable = getattr(node, "variable", None)
                if variable is not None:
                    reached[node] = (variable is self.tokens,
                                     frozenset((id(variable),)) if id(variable) in leaves else frozenset())
                else:
                    below = [reach(after) for after, _ in node.next_functions if after is not None]
                    reached[node] = (any(tokens for tokens, _ in below), frozenset().union(*(w for _, w in below)))
            return reached[node]

        reach(self.out.grad_fn)
        joins: dict[frozenset[int], Optional[set[Any]]] = {}
        for node, (tokens, _) in reached.items():
            for after, _ in getattr(node, "next_functions", ()) if tokens else ():
                if after is not None and not reached[after][0] and reached[after][1]:
                    joins.setdefault(reached[after][1], set()).add(node)
        covered = [leaf for weights in joins for leaf in weights]
        if len(covered) != len(set(covered)) or any(
                _below_on_tokens_path(node, nodes, reached) for nodes in joins.values() for node in nodes):
            return None
        if leaves - set(covered):
            joins[frozenset(leaves - set(covered))] = None
        return joins

    def release(self) -> None:
        self.tokens, self.leaves, self.out, self.grad = None, [], None, None
        self.received, self.joins = None, {}


def _receive(received: dict, node: Any, grads: tuple) -> None:
    received[node] = grads


def _below_on_tokens_path(node: Any, others: set[Any], reached: dict[Any, tuple[bool, frozenset[int]]]) -> bool:
    """Whether one of `others` lies below `node` on the tokens' path."""
    seen, stack = set(), [after for after, _ in node.next_functions if after is not None]
    while stack:
        current = stack.pop()
        if current in seen or not reached[current][0]:
            continue
        if current in others:
            return True
        seen.add(current)
        stack.extend(after for after, _ in current.next_functions if after is not None)
    return False


class _WeightNode(torch.autograd.Function):
    """A 0-d tap of the weights; backward gives their gradients from the call's inner graph."""

    @staticmethod
    def forward(ctx: Any, call: ExpertCall, *weights: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        return torch.zeros((), device=weights[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        return (None, *ctx.call.weight_grads())


class _InputNode(torch.autograd.Function):
    """The module's forward; backward gives the tokens' gradient, and the tap's (zero) once the
    weight node will need the output's gradient it keeps."""

    @staticmethod
    def forward(ctx: Any, call: ExpertCall, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                tap: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.call, ctx.tokens_node = call, tokens.grad_fn
        return call.run(tokens, experts, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        call, with_weights = ctx.call, ctx.needs_input_grad[4]
        call.grad = grad
        tokens_grad = None
        # The weight step of a split pipeline backward runs this node again for the weights
        # only: the tokens' send-back node is not part of it.
        if ctx.needs_input_grad[1] and (ctx.tokens_node is None
                                        or torch._C._will_engine_execute_node(ctx.tokens_node)):
            tokens_grad = call.input_grad(keep=with_weights)
        if not with_weights:
            call.release()
        tap_grad = torch.zeros((), device=grad.device) if with_weights else None
        return None, tokens_grad, None, None, tap_grad

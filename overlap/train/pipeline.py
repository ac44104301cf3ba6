"""`overlap train --pp N`: the GPT cut into pipeline stages (N, or 2 N under the interleaved
schedules, two per rank), each sharded over its data-parallel ranks with
`overlap.fully_shard` (blocks, then the stage) and driven by torch's pipeline schedule: one
reduction per step, units kept gathered across the step's microbatches (docs/pipeline.md).

[Note: the tied head across stages]
The GPT's output head shares the embedding's weight. Cut into stages, the embedding lives on
the first stage and the head on the last, each a copy, equal at the start. After the step's
gradients are reduced, the two copies' gradients are summed across the first and last stage
(Megatron's embedding group does the same), so both take the same optimizer steps and stay
equal: the stages train as the tied model does, and the gradient norm counts the weight once.

[Note: the routers' loss across stages]
With --moe the loss of a microbatch is the language model's plus each MoE block's
load-balancing loss (GPTMoE's), but a stage hands on only its activations and the schedule
computes the loss on the last stage alone. So each MoE block's weighted loss joins the
backward where it is made: the block's output passes through `_RouterLoss`, which returns the
output unchanged and, in backward, gives the block's loss the gradient 1 (Megatron's
auxiliary-loss scaler); the schedule's scaling by the microbatches then averages it with the
rest. For the report, each stage keeps its microbatches' weighted losses, and after the step
their sum over the stages joins the last stage's mean.

[Note: validation through the stages]
Validation runs no schedule: each rank runs its stages on the whole batch in stage order,
receiving a stage's input from the rank of the stage before and sending its output to the
rank of the next (or keeping it, where that stage is its own), and the last stage's rank takes
the loss. Forward alone needs no microbatches, and torch 2.13's `schedule.eval()` fails under
the V-shaped schedules (it runs their backward hand-over between a rank's two stages). The
loss is the whole batch's mean, as the job without stages takes it.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import functional as F

from overlap import OverlapPolicy, follow_schedule, fully_shard
from overlap.models import GPT, GPTConfig
from overlap.models.moe import GPTMoE, MoEConfig
from overlap.observe.report import OverlapMonitor
from overlap.train.batches import ByteBatches
from overlap.train.options import V_SHAPED_SCHEDULES, stages_per_rank
from overlap.train.schedule import learning_rate


class _RouterLoss(torch.autograd.Function):
    """`x` unchanged; backward also gives `loss` the gradient 1 (see [Note: the routers' loss
    across stages])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


class _Stage(nn.Module):
    """Blocks of the GPT, named by their index in the whole model, with the embeddings on the
    first stage and the final norm and head on the last."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        # The weight of the routers' loss (GPT-MoE's blocks), and each forward's weighted sum of
        # it over this stage's blocks, kept for the report.
        self.router_weight = getattr(gpt.config, "aux_loss_weight", None)
        self.router_losses: list[float] = []
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in blocks})
        if last:
            self.ln_f = gpt.ln_f
            self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())   # the tied copy
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        weighted = []
        for block in self.blocks.values():
            x = block(x)
            if self.router_weight is not None:
                weighted.append(self.router_weight * block.moe.aux_loss)
                if torch.is_grad_enabled():
                    x = _RouterLoss.apply(x, weighted[-1])
        if weighted:
            self.router_losses.append(float(sum(weighted).detach()))
            if torch.is_grad_enabled() and not self.last:
                # A stage's output is detached in place after a split backward's input step,
                # which the view `_RouterLoss` returns does not allow.
                x = x.clone()
        return self.lm_head(self.ln_f(x)) if self.last else x


def _whole(config: GPTConfig) -> GPT:
    return GPTMoE(config) if isinstance(config, MoEConfig) else GPT(config)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def stage_blocks(layers: int, stages: int, index: int) -> range:
    """The blocks of stage `index`: consecutive, as even as the count allows (the first
    stages take one more)."""
    size, extra = divmod(layers, stages)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def stage_indices(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline dimension holds under `schedule`: itself;
    under the interleaved schedules also its stage of the second loop; under the V-shaped ones
    its stage on the way back (rank 0 holds the first and the last)."""
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    return [pp_rank, 2 * pp - 1 - pp_rank] if schedule in V_SHAPED_SCHEDULES else [pp_rank, pp_rank + pp]


def stage_owner(schedule: str, pp: int, index: int) -> int:
    """The rank of the pipeline dimension that holds stage `index` (see `stage_indices`)."""
    return next(rank for rank in range(pp) if index in stage_indices(schedule, pp, rank))


def copy_rows(full: torch.Tensor, target: DTensor) -> None:
    """This rank's part of `full` into `target`, where its placement puts it."""
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    target.to_local().copy_(full[tuple(slice(start, start + size) for start, size in zip(offset, shape))])


class PipelineSteps:
    """One rank's stages of the pipeline job (one, or two under the interleaved schedules):
    their training step and their validation loss."""

    def __init__(self, args: argparse.Namespace, config: GPTConfig, device: torch.device,
                 batches: ByteBatches) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        world, pp = dist.get_world_size(), args.pp
        mesh = init_device_mesh(device.type, (pp, world // pp), mesh_dim_names=("pp", "dp"))
        self.pp_group = mesh["pp"].get_group()
        indices = stage_indices(args.pp_schedule, pp, mesh.get_local_rank("pp"))
        count = pp * len(indices)
        # Every rank builds the whole model from the seed (the values of the job's own meta
        # build) and keeps its stages.
        torch.manual_seed(args.seed)
        gpt = _whole(config)
        # The whole model's optimizer groups by parameter name, as a checkpoint lists them.
        names = {id(param): name for name, param in gpt.named_parameters()}
        self.group_names = [[names[id(param)] for param in group["params"]]
                            for group in gpt.optimizer_groups(gpt.named_parameters(), 0.0)]
        policy = dict(mesh=mesh["dp"], offload_policy=CPUOffloadPolicy() if args.offload == "cpu" else OffloadPolicy(),
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16"
                      else MixedPrecisionPolicy())
        self.modules: list[nn.Module] = []
        stages = []
        for index in indices:
            stage = _Stage(gpt, stage_blocks(args.layers, count, index), index == 0, index == count - 1)
            for block in stage.blocks.values():
                fully_shard(block, **policy)
            # The job's runtime options, each stage's (the same on every stage).
            runtime = OverlapPolicy(prefetch_depth=args.prefetch_depth, bucket_mb=args.bucket_mb,
                                    compression=args.compress, compile=args.compile,
                                    expert_parallel=args.expert_parallel)
            self.modules.append(fully_shard(stage, overlap_policy=runtime, **policy))
            stages.append(PipelineStage(self.modules[-1], index, count, device, group=self.pp_group))
        self.first = any(module.first for module in self.modules)
        self.last = any(module.last for module in self.modules)
        kind = getattr(pipelining, f"Schedule{args.pp_schedule}")
        self.schedule = kind(stages if len(stages) > 1 else stages[0], n_microbatches=args.microbatches,
                             loss_fn=_loss)
        # The ranks that hold the first and the last stage (rows of the mesh), of each
        # data-parallel index: see [Note: the tied head across stages]. Every rank makes every
        # group, in the same order. Under the V-shaped schedules one rank holds both: no group.
        self.tie_group = None
        last_row = stage_owner(args.pp_schedule, pp, count - 1)
        for column in range(world // pp) if last_row != 0 else ():
            ranks = [int(mesh.mesh[0, column]), int(mesh.mesh[last_row, column])]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                self.tie_group = group
        # Built now, on every rank (a collective over the stage's ranks): the parameters are
        # the runtimes' DTensors from here on. The report and the monitor are the first stage's.
        runtimes = [module.overlap_runtime for module in self.modules]
        # Gathers between passes in the order of the schedule's actions, and compiled blocks
        # under a split backward (overlap/schedule_prefetch.py).
        follow_schedule(self.schedule)
        self.module, self.runtime = self.modules[0], runtimes[0]
        # This rank's copies of the tied weight: one where the first and the last stage are on
        # different rows, both where they are on the same (the V-shaped schedules).
        self.tied = [module.wte.weight if module.first else module.lm_head.weight
                     for module in self.modules if module.first or module.last]
        self.indices, self.count = indices, count
        self.args, self.batches = args, batches
        # This rank's batch shards ([Note: batch shards]), set once a resume has said how many
        # the run's global batch holds.
        self.shards = range(0)

    @property
    def monitor(self) -> OverlapMonitor:
        return self.runtime.overlap_monitor

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        return GPT.optimizer_groups([pair for module in self.modules for pair in module.named_parameters()],
                                    weight_decay)

    def train(self, optimizer: torch.optim.Optimizer, step: int, clip_norm: float) -> Optional[float]:
        """One optimizer step over this rank's shards of the global batch (--batch sequences
        each, all in --microbatches): this rank's mean loss on the last stage, else None."""
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, self.args)
        losses: list[torch.Tensor] = []
        inputs, targets = self._batch("train", step)
        self.schedule.step(*((inputs,) if self.first else ()),
                           **({"target": targets, "losses": losses} if self.last else {}))
        router = self._router_loss()
        self._sum_tied_grads()
        self._clip(clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) + router if self.last else None

    def _batch(self, split: str, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of the batch, one after another: the mean loss over them is the
        mean of the shards' means, which the job without stages accumulates shard by shard."""
        pairs = [self.batches.get(split, self.args.batch, draw, shard) for shard in self.shards]
        return torch.cat([inputs for inputs, _ in pairs]), torch.cat([targets for _, targets in pairs])

    def _router_loss(self, forwards: Optional[int] = None) -> float:
        """The routers' weighted loss of the last `forwards` of each stage (the schedule's
        last run: its microbatches), averaged over them and summed over the stages
        (collective over the pipeline; 0 without MoE blocks): see [Note: the routers' loss
        across stages]."""
        if not self.args.moe:
            return 0.0
        count = forwards or self.args.microbatches
        # The last `count` forwards are the run's (torch's first run infers shapes with one more).
        total = torch.tensor(sum(sum(module.router_losses[-count:]) for module in self.modules), dtype=torch.float64)
        for module in self.modules:
            module.router_losses.clear()
        dist.all_reduce(total, group=self.pp_group)
        return float(total) / count

    def _sum_tied_grads(self) -> None:
        """See [Note: the tied head across stages]."""
        if not self.tied:
            return
        grads = [param.grad for param in self.tied]
        total = sum(grad.full_tensor() for grad in grads)
        if self.tie_group is not None:
            dist.all_reduce(total, group=self.tie_group)
        # The two copies' rows split alike only if their stages' flat layouts do: each takes
        # its own rows of the sum, where its placement puts them.
        for grad in grads:
            copy_rows(total, grad)

    def _clip(self, max_norm: float) -> None:
        """torch's clip over the whole model: each stage's squared norm summed over the stages
        (the tied weight counted once, on the first stage)."""
        grads = [p.grad for module in self.modules for name, p in module.named_parameters()
                 if p.grad is not None and not (module.last and name == "lm_head.weight")]
        norm = torch.nn.utils.get_total_norm(grads)
        square = (norm.full_tensor() if isinstance(norm, DTensor) else norm).double().square()
        dist.all_reduce(square, group=self.pp_group)
        torch.nn.utils.clip_grads_with_norm_([p for module in self.modules for p in module.parameters()], max_norm,
                                             square.sqrt().float())

    def whole_model(self, config: GPTConfig) -> Optional[GPT]:
        """The whole GPT on rank 0, from every stage's full values (collective over the
        world: each stage's data-parallel ranks gather its values, one of them sends them);
        None on the other ranks. The GPT's tied head takes the last stage's copy, equal to
        the embedding (see [Note: the tied head across stages])."""
        values: dict[str, torch.Tensor] = {}
        for module in self.modules:
            values.update(get_model_state_dict(module, options=StateDictOptions(full_state_dict=True)))
        sender = dist.get_rank(self.modules[0].overlap_runtime.collectives.all_group) == 0
        stages: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object({key: value.detach().cpu() for key, value in values.items()} if sender else {}, stages,
                           dst=0)
        if stages is None:
            return None
        model = _whole(config)
        model.load_state_dict({key: value for part in stages for key, value in part.items()})
        return model

    @torch.no_grad()
    def val_loss(self, draws: int) -> Optional[float]:
        """This rank's mean loss over `draws` validation batches, on the last stage. See
        [Note: validation through the stages]."""
        for module in self.modules:
            module.eval()
        losses: list[float] = []
        for draw in range(draws):
            inputs, targets = self._batch("val", draw)
            loss = self._through_stages(inputs, targets)
            router = self._router_loss(forwards=1)
            if loss is not None:
                losses.append(loss + router)
        for module in self.modules:
            module.train()
        return sum(losses) / len(losses) if self.last else None

    def _through_stages(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[float]:
        """The whole batch through every stage in order, each rank running its own and handing
        the activations on; the loss on the rank of the last stage, else None."""
        me, schedule, pp = dist.get_rank(self.pp_group), self.args.pp_schedule, self.args.pp
        shape = (*inputs.shape, self.args.hidden)
        dtype = torch.bfloat16 if self.args.mixed_precision == "bf16" else torch.float32
        x, loss = inputs, None
        for index, module in sorted(zip(self.indices, self.modules), key=lambda pair: pair[0]):
            before = stage_owner(schedule, pp, index - 1) if index > 0 else me
            if before != me:
                x = torch.empty(shape, dtype=dtype, device=inputs.device)
                dist.recv(x, group=self.pp_group, group_src=before)
            x = module(x)
            if index == self.count - 1:
                loss = float(_loss(x, targets))
            elif (after := stage_owner(schedule, pp, index + 1)) != me:
                dist.send(x.contiguous(), group=self.pp_group, group_dst=after)
        return loss

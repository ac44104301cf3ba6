"""A tensor-parallel plan for the reference GPT, for torch's `parallelize_module`."""
from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def gpt_tp_plan() -> dict[str, ParallelStyle]:
    """Every linear layer of the blocks split over the tp mesh: the MLP as Megatron splits it
    (fc by columns, out by rows: one all-reduce of the output), attention's fused qkv by
    columns and gathered back (its [q; k; v] rows are not head-aligned, so the heads cannot
    stay split) and its projection by rows from the replicated input (one all-reduce). The
    embeddings, norms and the tied head stay whole on every tp rank."""
    return {"blocks.*.attn.qkv": ColwiseParallel(output_layouts=Replicate()),
            "blocks.*.attn.proj": RowwiseParallel(input_layouts=Replicate()),
            "blocks.*.fc": ColwiseParallel(), "blocks.*.out": RowwiseParallel()}

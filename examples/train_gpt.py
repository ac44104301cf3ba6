"""Train a small GPT with ShardedModule (ZeRO-3): the whole loop in one readable file.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # CPU: gloo, 2 ranks
    torchrun --nproc-per-node 8 examples/train_gpt.py --steps 200 # one rank per GPU: nccl (not yet run on a GPU)

The data is a fixed set of random token sequences, so the model can only learn by
memorising them: the loss falls from ln(vocab) towards zero. Each rank draws its own
batches; ShardedModule averages the gradients across ranks.
"""
import argparse
import math
import time

import torch
import torch.distributed as dist

from overlap import MixedPrecision, ShardedModule
from overlap.models import GPT, Block, GPTConfig

parser = argparse.ArgumentParser(description="train a small GPT with ShardedModule")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--vocab", type=int, default=512)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--bf16", action="store_true", help="gather parameters and reduce gradients in bfloat16")
args = parser.parse_args()

# ---- one process per rank, started by torchrun -------------------------------------------
use_cuda = torch.cuda.is_available()
if use_cuda:
    torch.cuda.set_device(dist.get_node_local_rank())
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

# ---- data: the same 64 random sequences on every rank ------------------------------------
torch.manual_seed(0)
dataset = torch.randint(args.vocab, (64, args.seq + 1))
batch_rng = torch.Generator().manual_seed(rank)   # but each rank picks its own batches


def get_batch():
    rows = dataset[torch.randint(len(dataset), (args.batch,), generator=batch_rng)]
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


# ---- model: each Block is one unit, gathered just before it runs ---------------------------
config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                   n_embd=args.hidden)
model = ShardedModule(
    GPT(config),
    unit_types=(Block,),
    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if args.bf16 else None,
)
# model.named_parameters() are the GPT's own parameters, each holding this rank's part, so the
# usual two groups (decay on weights, none on norms and biases) are made by name, and the
# optimizer state is sharded too.
optimizer = torch.optim.AdamW(model.module.optimizer_groups(model.named_parameters(), 0.1), lr=args.lr)
if rank == 0:
    print(f"{config.num_params / 1e6:.2f}M parameters, {world} ranks, {len(model.scheduler.units)} units, "
          f"loss starts near ln({args.vocab}) = {math.log(args.vocab):.2f}")

# ---- training loop --------------------------------------------------------------------------
for step in range(1, args.steps + 1):
    started = time.perf_counter()
    inputs, targets = get_batch()
    loss = model(inputs, targets)      # all-gathers run ahead of each block (prefetch)
    loss.backward()                    # gradients are reduce-scattered while backward goes on
    model.clip_grad_norm_(1.0)
    optimizer.step()                   # plain AdamW on this rank's parts
    optimizer.zero_grad(set_to_none=True)

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    if rank == 0 and (step % 10 == 0 or step == 1):
        print(f"step {step:4d}  loss {mean_loss.item():.4f}  {1e3 * (time.perf_counter() - started):.0f} ms")

# ---- a full copy of the weights, e.g. for saving ---------------------------------------------
state = model.full_state_dict()
if rank == 0:
    print(f"done; full state dict has {sum(v.numel() for v in state.values()) / 1e6:.2f}M values")
dist.destroy_process_group()

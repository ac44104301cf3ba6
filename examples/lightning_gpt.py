"""Train a small GPT with Lightning's Trainer and overlap's ZeRO-3 strategy.

    python examples/lightning_gpt.py                 # CPU: Lightning starts 2 gloo ranks itself
    python examples/lightning_gpt.py --devices 8     # one rank per GPU (nccl): written for it, not yet run on a GPU

The GPT is built in `configure_model` on the meta device: no rank ever holds the full model
in memory before `OverlapStrategy` shards it (each unit is materialised, then sharded). The
Trainer's own options work as usual: gradient accumulation runs the accumulating batches
without communication, clipping sees every rank's gradients, and `save_checkpoint` writes a
sharded directory that `fit(ckpt_path=...)` resumes from, at any number of ranks.
"""
import argparse
import math
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from overlap.integrations.lightning import OverlapStrategy
from overlap.models import GPT, Block, GPTConfig

parser = argparse.ArgumentParser(description="train a small GPT with Lightning and OverlapStrategy")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--vocab", type=int, default=128)
parser.add_argument("--out", default="lightning_gpt_out", help="checkpoint and exported weights go here")
args = parser.parse_args()


class LitGPT(pl.LightningModule):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.gpt = None

    def configure_model(self) -> None:
        # Runs under OverlapStrategy's meta-device context: shapes only, no memory.
        if self.gpt is None:
            self.gpt = GPT(self.config)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = self.gpt(inputs, targets)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # Called after wrapping: the parameters are this rank's parts, grouped by name.
        groups = self.gpt.optimizer_groups(self.gpt.named_parameters(), weight_decay=0.1)
        return torch.optim.AdamW(groups, lr=1e-2)


def main() -> None:
    torch.manual_seed(0)
    rows = torch.randint(args.vocab, (32, args.seq + 1))          # memorisable random sequences
    loader = DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=8, shuffle=True)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                       n_embd=args.hidden)
    model = LitGPT(config)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = pl.Trainer(accelerator=accelerator, devices=args.devices, max_steps=args.steps,
                         strategy=OverlapStrategy(unit_types=(Block,)), accumulate_grad_batches=2,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False, log_every_n_steps=10)
    trainer.fit(model, loader)

    # A sharded checkpoint (a directory; every rank writes its parts) ...
    trainer.save_checkpoint(os.path.join(args.out, "last.ckpt"))
    # ... and the full weights for inference, gathered unit by unit onto rank 0.
    state = trainer.strategy.full_state_dict()
    if trainer.is_global_zero:
        torch.save(state, os.path.join(args.out, "gpt.pt"))
        loss = trainer.callback_metrics["loss"].item()
        print(f"{config.num_params / 1e6:.2f}M parameters on {trainer.world_size} ranks: loss {loss:.3f} after "
              f"{trainer.global_step} steps (from ln({args.vocab}) = {math.log(args.vocab):.2f}); "
              f"checkpoint in {args.out}/last.ckpt, weights in {args.out}/gpt.pt")
    # Lightning leaves the process group up; gloo's threads outliving the interpreter's
    # teardown can abort the process at exit.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()             # the ranks take the group down together, after rank 0's save
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

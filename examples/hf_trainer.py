"""Train a Hugging Face model with `transformers.Trainer`, sharded by overlap (ZeRO-3).

    torchrun --nproc-per-node 2 examples/hf_trainer.py              # CPU: 2 gloo ranks
    torchrun --nproc-per-node 8 examples/hf_trainer.py --steps 200  # one rank per GPU (not yet run on a GPU)

`OverlapTrainer` is `Trainer` with the model wrapped in `ShardedModule` (Accelerate does not
wrap it again in DDP). Everything else is the Trainer you know: `TrainingArguments` for
gradient accumulation and clipping, checkpoints that `train(resume_from_checkpoint=True)`
continues, and `save_model` writing a folder that `from_pretrained` loads on one process.
The model is a small GPT-2 made from its config (no download), the data random sequences it
can only learn by memorising them.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from overlap.integrations.hf import OverlapTrainer

parser = argparse.ArgumentParser(description="train a small GPT-2 with transformers.Trainer and OverlapTrainer")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default="hf_trainer_out", help="checkpoints and the final model folder go here")
args = parser.parse_args()


class RandomSequences(torch.utils.data.Dataset):
    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's class name does not say which loss it computes; naming it lets Trainer
    # count the predicted tokens right (all but the first of each row).
    model.loss_type = "ForCausalLM"
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=1e-2, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=10,
        save_steps=args.steps // 2, report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = OverlapTrainer(model=model, args=training, train_dataset=RandomSequences(32, 32, config.vocab_size),
                             unit_types=(GPT2Block,))
    # Started again, it continues from the newest checkpoint in --out.
    resume = os.path.isdir(args.out) and any(name.startswith("checkpoint-") for name in os.listdir(args.out))
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    final = os.path.join(args.out, "final")
    trainer.save_model(final)                   # gathered onto rank 0, written by save_pretrained

    if trainer.is_world_process_zero():
        # One process, no overlap: the folder is an ordinary Hugging Face model.
        loaded = GPT2LMHeadModel.from_pretrained(final)
        prompt = trainer.train_dataset[0]["input_ids"][:8]
        generated = loaded.generate(prompt[None], max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 8:]
        expected = trainer.train_dataset[0]["input_ids"][8:16]
        print(f"{model.num_parameters() / 1e6:.2f}M parameters on {training.world_size} ranks: training loss "
              f"{result.training_loss:.3f} (from ln(128) = {math.log(128):.2f}); {final} reloaded with from_pretrained "
              f"continues a training sequence with {(generated == expected).sum().item()}/8 tokens right")
    if dist.is_initialized():
        dist.barrier()                          # the ranks take the group down together, after rank 0's check
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of a short run that checkpoints (a save, and an asynchronous save waited for
after the last step), destroys its process group and returns: the interpreter's own shutdown
follows."""
import faulthandler
import os
import sys

import torch
import torch.distributed as dist

from overlap import ShardedModule
from overlap import checkpoint
from overlap.models import GPT, GPTConfig

STUCK_AFTER_S = 200


def main(directory: str) -> None:
    # A rank stuck (at exit too) prints every thread's stack and ends, for the test to show.
    faulthandler.dump_traceback_later(STUCK_AFTER_S, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ShardedModule(GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pending = None
    for step in range(3):
        tokens = torch.randint(0, 97, (4, 17))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            checkpoint.save(os.path.join(directory, "step-0"), model, optimizer)
        if step == 1:
            pending = checkpoint.async_save(os.path.join(directory, "step-1"), model, optimizer)
    pending.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

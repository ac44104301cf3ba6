"""Step time of the same GPT-2 under each framework integration, against the hand-written loop
with `ShardedModule` (`loop`): Lightning with `OverlapStrategy` (`lightning`), `OverlapTrainer`
(`hf`), and each framework's own FSDP where it runs on CPU (`lightning-fsdp`, `lightning-fsdp2`,
`hf-fsdp`; a variant that fails records why). 2 gloo ranks, AdamW, clipping at 1.0; a step is
timed between the framework's step hooks on rank 0. Each variant is a launch of its own, the
order rotating every round; ratios to the loop are per round.

    python benchmarks/integrations.py --rounds 4 --steps 20 --warmup 5 --out docs/results/integrations.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

from common import (RunRecord, add_options, arg_parser, launch, median, parse_with_worker_options, print_and_write,
                    quartiles, rotated, script_main, write_json)

VARIANTS = ("loop", "lightning", "hf", "lightning-fsdp", "lightning-fsdp2", "hf-fsdp")
CONFIG = dict(vocab_size=512, n_positions=128, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
BATCH, SEQ, LR = 4, 128, 1e-3
LAUNCH_TIMEOUT_S = 600.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = arg_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12, help="steps per variant per round, warm-up included")
    add_options(parser, rounds=3, warmup=4, out=None)
    return parse_with_worker_options(parser, argv, VARIANTS)


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    model.loss_type = "ForCausalLM"
    return model


def _rows(count: int):
    import torch

    return torch.randint(CONFIG["vocab_size"], (count, SEQ), generator=torch.Generator().manual_seed(0))


def _loop(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from overlap import ShardedModule

    dist.init_process_group("gloo")
    model = ShardedModule(_model(), unit_types=(GPT2Block,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows, times = _rows(steps * BATCH * dist.get_world_size()), []
    for step in range(steps):
        first = (step * dist.get_world_size() + dist.get_rank()) * BATCH
        ids = rows[first:first + BATCH]
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times


def _lightning(steps: int, strategy_name: str) -> list[float]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from overlap.integrations.lightning import OverlapStrategy

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = _model()
            self.times: list[float] = []

        def configure_model(self) -> None:
            if strategy_name == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                from peers import shard_by_block

                shard_by_block(fully_shard, self.gpt, self.gpt.transformer.h)

        def training_step(self, batch, batch_idx):
            return self.gpt(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_start(self, batch, batch_idx) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._started)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    world = int(os.environ["WORLD_SIZE"])
    if strategy_name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(auto_wrap_policy={GPT2Block})
    elif strategy_name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = OverlapStrategy(unit_types=(GPT2Block,))
    module = Lit()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=1.0, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(TensorDataset(_rows(steps * BATCH * world)), batch_size=BATCH))
    return module.times


def _hf(steps: int, fsdp: bool) -> list[float]:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from overlap.integrations.hf import OverlapTrainer

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **_):
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            self.times.append(time.perf_counter() - self._started)

    world = int(os.environ["WORLD_SIZE"])
    times = StepTimes()
    extra: dict[str, Any] = {}
    if fsdp:
        extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=steps,
                             learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", optim="adamw_torch",
                             max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0, **extra)
    dataset = [{"input_ids": row, "labels": row} for row in _rows(steps * BATCH * world)]
    if fsdp:
        trainer = Trainer(model=_model(), args=args, train_dataset=dataset, callbacks=[times])
    else:
        trainer = OverlapTrainer(model=_model(), args=args, train_dataset=dataset, callbacks=[times],
                                 unit_types=(GPT2Block,))
    trainer.train()
    return times.times


def run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        if args.worker == "loop":
            result = {"times": _loop(args.steps)}
        elif args.worker.startswith("lightning"):
            result = {"times": _lightning(args.steps, args.worker.partition("-")[2] or "overlap")}
        else:
            result = {"times": _hf(args.steps, fsdp=args.worker.endswith("fsdp"))}
    except Exception as exc:  # noqa: BLE001 - a framework's FSDP that does not run on CPU is a result
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(args.result, result)


def _launch(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        return launch(os.path.abspath(__file__), 2, ["--worker", variant, "--steps", str(args.steps)], LAUNCH_TIMEOUT_S,
                      env={"HF_HUB_OFFLINE": "1"})
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc).splitlines()[0][:300]}


def run_driver(args: argparse.Namespace) -> int:
    failed: dict[str, str] = {}
    per_round: list[dict[str, float]] = []
    record = RunRecord("integrations.py", args.argv)
    for round_index in range(args.rounds):
        times: dict[str, float] = {}
        for variant in rotated(VARIANTS, round_index):
            if variant in failed:
                continue
            result = _launch(variant, args)
            if "error" in result:
                failed[variant] = result["error"]
                print(f"round {round_index}: {variant} failed: {result['error']}", file=sys.stderr)
                continue
            times[variant] = statistics.median(result["times"][args.warmup:])
            print(f"round {round_index}: {variant} {1e3 * times[variant]:.1f} ms/step", file=sys.stderr)
        per_round.append(times)
    summary = {}
    for variant in VARIANTS:
        if variant in failed:
            continue
        step = [r[variant] for r in per_round if variant in r]
        ratios = [r[variant] / r["loop"] for r in per_round if variant in r and "loop" in r]
        summary[variant] = {"step_ms_median": 1e3 * median(step), "step_ms_iqr": [1e3 * q for q in quartiles(step)],
                            "ratio_to_loop_median": median(ratios), "ratios_per_round": ratios}
    result = {
        **record.fields(), "world_size": 2, "model": CONFIG, "batch_per_rank": BATCH, "seq": SEQ,
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "versions": _versions(), "variants": summary, "failed": failed, "per_round_s": per_round,
    }
    print_and_write(json.dumps(summary, indent=1), args.out, result)
    # A failed variant is named (Lightning's FSDP1 refuses the CPU); without the loop the run fails.
    return 1 if "loop" in failed else 0


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("lightning", "transformers", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


if __name__ == "__main__":
    sys.exit(script_main(None, parse_args, run_worker, run_driver))

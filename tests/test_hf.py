"""OverlapTrainer under the real transformers Trainer and Accelerate, on 2 gloo ranks, with a tiny
GPT-2 built from its config (no download): no DDP around the ShardedModule; with gradient
accumulation and clipping, the same losses as the hand-written ShardedModule loop and as one
process on the whole batch; `resume_from_checkpoint` continues with the same losses and
weights; the `save_model` folder loads with `from_pretrained` to the same logits."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402

CONFIG = dict(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
WORLD, MICRO, ACCUMULATE, STEPS, SEQ = 2, 2, 2, 4, 12
LR, CLIP = 3e-3, 0.05


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    # transformers finds the loss by the class name, and "GPT2LMHeadModel" names none: Trainer
    # would then count every label of a row where the loss predicts all but the first, and scale
    # the loss (and the gradients) by SEQ-1/SEQ. Named, as *ForCausalLM models are by their names.
    model.loss_type = "ForCausalLM"
    return model


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CONFIG["vocab_size"], (STEPS * ACCUMULATE * WORLD * MICRO, SEQ), generator=g)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _trainer(directory: str, model: torch.nn.Module, **kwargs):
    from transformers import TrainerCallback, TrainingArguments

    from overlap.integrations.hf import OverlapTrainer

    class InOrder(OverlapTrainer):
        """Batches in dataset order, so that the references can take the same ones."""

        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **_):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=directory, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=CLIP,
        weight_decay=0.0, logging_steps=1, save_strategy="steps", save_steps=STEPS // 2, report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    losses = Losses()
    trainer = InOrder(model=model, args=args, train_dataset=_Rows(_tokens()), callbacks=[losses],
                      unit_types=(transformers.models.gpt2.modeling_gpt2.GPT2Block,), **kwargs)
    return trainer, losses


def _hand_written(rank: int, world: int) -> list[float]:
    """The same steps written out with ShardedModule: this rank's micro-batches, no_sync, clip."""
    from overlap import ShardedModule

    model = ShardedModule(_model(), unit_types=(transformers.models.gpt2.modeling_gpt2.GPT2Block,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens, losses = _tokens(), []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            batch = (step * ACCUMULATE + micro) * world + rank
            ids = tokens[batch * MICRO:(batch + 1) * MICRO]
            context = model.no_sync() if micro < ACCUMULATE - 1 else torch.enable_grad()
            with context:
                loss = model(input_ids=ids, labels=ids).loss / ACCUMULATE
                loss.backward()
            total += loss.detach()
        model.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _train_save_resume(rank: int, world: int, directory: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from overlap import ShardedModule

    hand_losses = _hand_written(rank, world)

    run = os.path.join(directory, "run")
    trainer, logged = _trainer(run, _model())
    trainer.train()
    # Nothing wrapped the ShardedModule: not Accelerate's prepare, not DDP.
    wrapping = (type(trainer.model_wrapped).__name__, trainer.model_wrapped is trainer.model,
                any(isinstance(m, DistributedDataParallel) for m in trainer.accelerator._models))
    trainer.save_model(os.path.join(directory, "final"))
    state = trainer.sharded_module.full_state_dict()
    ids = _tokens()[:3]
    trainer.sharded_module.eval()
    with torch.no_grad():
        logits = trainer.sharded_module(input_ids=ids).logits

    torch.manual_seed(123)          # other initial weights: the checkpoint must replace them
    resumed, resumed_logged = _trainer(run, _model())
    resumed.train(resume_from_checkpoint=os.path.join(run, f"checkpoint-{STEPS // 2}"))
    return {"hand_losses": hand_losses, "losses": logged.losses, "wrapping": wrapping, "state": state,
            "logits": logits, "resumed_losses": resumed_logged.losses,
            "resumed_state": resumed.sharded_module.full_state_dict(),
            "is_sharded": isinstance(trainer.model, ShardedModule)}


def _one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on each step's whole global batch."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens, losses = _tokens(), []
    per_step = ACCUMULATE * WORLD * MICRO
    for step in range(STEPS):
        ids = tokens[step * per_step:(step + 1) * per_step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    directory = str(tmp_path_factory.mktemp("hf"))
    return directory, run_distributed(_train_save_resume, WORLD, directory, env={"HF_HUB_OFFLINE": "1"},
                                      timeout=300)


def test_trainer_matches_hand_written_loop_and_one_process(hf_run) -> None:
    _, results = hf_run
    reference_losses, reference_state = _one_process()
    for result in results:
        assert result["is_sharded"]
        assert result["wrapping"] == ("ShardedModule", True, False)
        assert len(result["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["hand_losses"]),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference_losses),
                                   rtol=1e-5, atol=1e-5)
        assert set(result["state"]) == set(reference_state)
        for key, value in reference_state.items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_resume_from_checkpoint_continues_identically(hf_run) -> None:
    _, results = hf_run
    for result in results:
        assert len(result["resumed_losses"]) == STEPS - STEPS // 2
        torch.testing.assert_close(torch.tensor(result["resumed_losses"]),
                                   torch.tensor(result["losses"][STEPS // 2:]), rtol=1e-6, atol=1e-6)
        for key, value in result["state"].items():
            torch.testing.assert_close(result["resumed_state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_saved_folder_loads_with_from_pretrained(hf_run) -> None:
    from transformers import GPT2LMHeadModel

    directory, results = hf_run
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(directory, "final")).eval()
    with torch.no_grad():
        logits = loaded(input_ids=_tokens()[:3]).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)

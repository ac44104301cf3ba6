"""OverlapStrategy under the real Lightning Trainer on gloo ranks: the same losses and weights as
Lightning's own DDP strategy (SGD with momentum, gradient accumulation through no_sync, norm
clipping), a sharded checkpoint that resumes at world sizes 1 and 3, a full state dict for
inference, and a model built in `configure_model` on the meta device."""
from __future__ import annotations

import os
import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

from distributed import run_distributed  # noqa: E402

VOCAB, D, SEQ, BATCH, STEPS = 29, 16, 8, 4, 4
ACCUMULATE, CLIP = 2, 0.05


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _lightning_module(build_in_configure_model: bool = False):
    import lightning.pytorch as pl

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.built = False
            if not build_in_configure_model:
                self.configure_model()
            self.losses: list[float] = []
            self.synced: list[bool] = []

        def configure_model(self) -> None:
            if self.built:
                return
            self.embed = nn.Embedding(VOCAB, D)
            self.blocks = nn.ModuleList([_Block() for _ in range(3)])
            self.head = nn.Linear(D, VOCAB)
            self.built = True

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            tokens, targets = batch
            loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
            self.losses.append(loss.item())
            return loss

        def on_before_backward(self, loss: torch.Tensor) -> None:
            model = self.trainer.strategy.model
            self.synced.append(bool(getattr(getattr(model, "scheduler", None), "sync_grads", True)))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    return TinyLM()


def _loader(batches: int, seed: int = 1):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batches * BATCH, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH // 2, shuffle=False)


def _trainer(strategy, world: int, steps: int, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
                      use_distributed_sampler=True, **kwargs)


def _batches(world: int) -> int:
    return STEPS * ACCUMULATE * world


def _overlap_vs_ddp(rank: int, world: int, directory: str) -> dict:
    """Lightning DDP, then OverlapStrategy, on the same data and initial weights; save."""
    from overlap.integrations.lightning import OverlapStrategy

    torch.manual_seed(0)
    reference = _lightning_module()
    _trainer("ddp", world, STEPS).fit(reference, _loader(_batches(world)))
    torch.manual_seed(0)
    model = _lightning_module()
    trainer = _trainer(OverlapStrategy(bucket_mb=0.001, prefetch_depth=1), world, STEPS)
    trainer.fit(model, _loader(_batches(world)))
    path = os.path.join(directory, "last.ckpt")
    trainer.save_checkpoint(path)
    full = trainer.strategy.full_state_dict(rank0_only=False)
    return {"ddp_losses": reference.losses, "losses": model.losses, "synced": model.synced,
            "ddp_state": {k: v.detach().clone() for k, v in reference.state_dict().items()},
            "state": full, "global_step": trainer.global_step, "path": path,
            "registered": "overlap" in __import__("lightning.pytorch.strategies", fromlist=["x"]).StrategyRegistry}


def _resume(rank: int, world: int, path: str, meta: bool) -> dict:
    """Resume the checkpoint at this world size: weights as saved, the step count carried on."""
    import lightning.pytorch as pl

    from overlap.integrations.lightning import OverlapStrategy

    seen: dict = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            seen["state"] = trainer.strategy.full_state_dict(rank0_only=False)
            seen["step"] = trainer.global_step

    torch.manual_seed(123)              # other initial weights: the checkpoint must replace them
    model = _lightning_module(build_in_configure_model=meta)
    trainer = _trainer("overlap", world, STEPS + 2, callbacks=[Capture()])
    assert isinstance(trainer.strategy, OverlapStrategy)
    trainer.fit(model, _loader(_batches(world) + 2 * ACCUMULATE * world), ckpt_path=path)
    return {"state": seen["state"], "step": seen["step"], "losses": model.losses, "final_step": trainer.global_step}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("lightning"))
    return run_distributed(_overlap_vs_ddp, 2, directory, timeout=300)


def test_losses_and_weights_match_lightning_ddp(trained: list[dict]) -> None:
    for result in trained:
        assert result["registered"]
        assert len(result["losses"]) == STEPS * ACCUMULATE
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ddp_losses"]),
                                   rtol=1e-5, atol=1e-6)
        for key, value in result["ddp_state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        # Every other batch only accumulates: it ran under no_sync.
        assert result["synced"] == [i % ACCUMULATE == ACCUMULATE - 1 for i in range(STEPS * ACCUMULATE)]
        assert result["global_step"] == STEPS
    assert os.path.isdir(trained[0]["path"])


@pytest.mark.parametrize("world, meta", [(1, False), (3, True)])
def test_checkpoint_resumes_at_another_world_size(trained: list[dict], world: int, meta: bool) -> None:
    results = run_distributed(_resume, world, trained[0]["path"], meta, timeout=300)
    saved = trained[0]["state"]
    for result in results:
        assert result["step"] == STEPS
        assert result["final_step"] == STEPS + 2
        assert len(result["losses"]) == 2 * ACCUMULATE
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["state"].keys() == saved.keys()
        for key, value in saved.items():
            torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0, msg=key)

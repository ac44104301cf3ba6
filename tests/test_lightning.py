"""OverlapStrategy under the real Lightning Trainer on gloo ranks: the same losses and weights as
Lightning's own DDP strategy (SGD with momentum, gradient accumulation through no_sync, norm
clipping), a sharded checkpoint that resumes at world sizes 1 and 3, a full state dict for
inference, a model built in `configure_model` on the meta device, and Fabric against one process."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

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

        def on_train_start(self) -> None:
            # Note when the strategy's model (DDP or ShardedModule) runs a backward under no_sync.
            model, self.in_no_sync = self.trainer.strategy.model, False
            no_sync = model.no_sync

            @contextlib.contextmanager
            def noted() -> Iterator[None]:
                with no_sync():
                    self.in_no_sync = True
                    try:
                        yield
                    finally:
                        self.in_no_sync = False

            model.no_sync = noted

        def on_before_backward(self, loss: torch.Tensor) -> None:
            self.synced.append(not self.in_no_sync)

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
    from lightning.pytorch.strategies import StrategyRegistry

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
            "registered": "overlap" in StrategyRegistry}


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


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _rows(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (STEPS * ACCUMULATE * 3 * 2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    first = ((step * ACCUMULATE + micro) * world + rank) * 2
    return tokens[first:first + 2, :-1], tokens[first:first + 2, 1:]


def _fabric_steps(fabric, model, optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(ACCUMULATE):
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = model(*_rows(step, micro, rank, world)) / ACCUMULATE
                fabric.backward(loss)
            total += loss.item()
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(torch.tensor(total), reduce_op="mean").item())
    return losses


def _fabric_run(rank: int, world: int, directory: str) -> dict:
    from lightning.fabric import Fabric

    from overlap.integrations.fabric import OverlapFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=OverlapFabricStrategy(bucket_mb=0.001))
    fabric.launch()

    def setup(seed: int):
        torch.manual_seed(seed)
        model = fabric.setup_module(_Net())
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        return model, optimizer

    model, optimizer = setup(0)
    losses = _fabric_steps(fabric, model, optimizer, range(STEPS - 1), rank, world)
    path = os.path.join(directory, "fabric")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS - 1})
    losses += _fabric_steps(fabric, model, optimizer, range(STEPS - 1, STEPS), rank, world)

    resumed, resumed_optimizer = setup(123)
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(path, state)
    resumed_losses = _fabric_steps(fabric, resumed, resumed_optimizer, range(state["step"], STEPS), rank, world)
    return {"losses": losses, "resumed_losses": resumed_losses, "step": state["step"],
            "state": fabric.strategy.full_state_dict(model, rank0_only=False),
            "resumed_state": fabric.strategy.full_state_dict(resumed, rank0_only=False)}


def test_fabric_matches_one_process_and_resumes(tmp_path) -> None:
    world = 2
    results = run_distributed(_fabric_run, world, str(tmp_path), timeout=240)
    torch.manual_seed(0)
    reference = _Net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        rows = [_rows(step, m, r, world) for m in range(ACCUMULATE) for r in range(world)]
        loss = reference(torch.cat([t for t, _ in rows]), torch.cat([y for _, y in rows]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        assert result["step"] == STEPS - 1
        assert result["resumed_losses"] == result["losses"][STEPS - 1:]
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
            torch.testing.assert_close(result["resumed_state"][key], result["state"][key], rtol=0, atol=0, msg=key)


def test_precision_names_map_to_policies() -> None:
    from overlap.integrations.lightning import OverlapStrategy
    from overlap.integrations.options import mixed_precision_for

    assert mixed_precision_for("32-true") is None and mixed_precision_for("bf16-true") is None
    assert mixed_precision_for("bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision_for("bf16-mixed").reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="16-mixed"):
        mixed_precision_for("16-mixed")
    from lightning.pytorch.plugins.precision import Precision

    fp16 = Precision()
    fp16.precision = "16-mixed"
    with pytest.raises(ValueError, match="16-mixed"):
        OverlapStrategy().precision_plugin = fp16

"""`overlap train --pp N --checkpoint-dir`: each rank's stages and their AdamW state, saved in
the whole model's terms, so the files are those `overlap.checkpoint.save` writes for the job
without stages (overlap.checkpoint.state). A run resumes at another pipeline layout (--pp,
--pp-schedule), at another count of data-parallel ranks, or without --pp; a run without
stages resumes with it. In those terms:
- keys are the whole model's names (a stage's modules keep them: overlap.train.pipeline);
- the last stage's copy of the tied head is the model's `lm_head.weight`, and its AdamW state
  is the embedding's, saved once (the copies take the same steps: [Note: the tied head across
  stages]), which the last stage loads;
- the optimizer's groups are the whole model's, each listing its parameters' names.
Every rank writes its own parts; the files are published whole or not at all, each item
checksummed."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overlap import checkpoint
from overlap.checkpoint.state import MODEL, OPTIM_STATE, PARAM_GROUPS, saved_groups
from overlap.train.checkpoints import Load, Write
from overlap.train.pipeline import copy_rows

# AdamW's state of one parameter: its step count and the two moments, shaped like it.
_STATE = ("step", "exp_avg", "exp_avg_sq")
TIED_HEAD, EMBEDDING = "lm_head.weight", "wte.weight"


def _state_key(name: str, key: str) -> str:
    return f"{OPTIM_STATE}{EMBEDDING if name == TIED_HEAD else name}.{key}"


def _parameters(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The stages' parameters, the tied head's copy last (its state is read from the embedding's)."""
    pairs = [pair for module in modules for pair in module.named_parameters()]
    return sorted(pairs, key=lambda pair: pair[0] == TIED_HEAD)


def _saved_items(modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                 group_names: list[list[str]]) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for module in modules:
        items.update({MODEL + name: value for name, value in module.state_dict().items()})
    for name, param in _parameters(modules):
        if name != TIED_HEAD:
            items.update({_state_key(name, key): value for key, value in optimizer.state.get(param, {}).items()})
    for number, (group, names) in enumerate(zip(optimizer.param_groups, group_names)):
        items.update({f"{PARAM_GROUPS}{number}.{setting}": names if setting == "params" else value
                      for setting, value in group.items()})
    return items


def stage_checkpoints(modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                      group_names: list[list[str]]) -> tuple[Load, Write]:
    """How this rank's stages and their optimizer are loaded and saved (called on every rank).
    `group_names`: the parameter names of the whole model's optimizer groups."""

    def load(path: str) -> dict:
        targets = {MODEL + name: value for module in modules for name, value in module.state_dict().items()}
        # Under the V-shaped schedules one rank holds the embedding and the tied head's copy:
        # the copy takes the embedding's loaded state, row by row in its own layout.
        copies: list[tuple[dict[str, Any], dict[str, Any]]] = []
        states = {}
        for name, param in _parameters(modules):
            state = {"step": torch.zeros((), dtype=torch.float32),
                     **{moment: torch.zeros_like(param) for moment in _STATE[1:]}}
            states[param] = state
            if name == TIED_HEAD and _state_key(name, "step") in targets:
                copies.append((state, {key: targets[_state_key(name, key)] for key in _STATE}))
            else:
                targets.update({_state_key(name, key): value for key, value in state.items()})
        groups = {key: None for key in checkpoint.saved_keys(path) if key.startswith(PARAM_GROUPS)}
        targets.update(groups)
        extra = checkpoint.load_items(path, targets)
        for state, source in copies:
            state["step"].copy_(source["step"])
            for moment in _STATE[1:]:
                copy_rows(source[moment].full_tensor(), state[moment])
        # The saved settings, once each group's names are checked against the whole model's.
        for group, saved in zip(optimizer.param_groups, saved_groups(path, targets, group_names)):
            group.update({setting: value for setting, value in saved.items() if setting != "params"})
        for module in modules:
            module.load_state_dict({name: targets[MODEL + name] for name in module.state_dict()})
        for param, state in states.items():
            optimizer.state[param] = state
        return extra

    def write(path: str, extra: dict) -> checkpoint.PendingSave:
        return checkpoint.async_save_items(path, _saved_items(modules, optimizer, group_names), extra)

    return load, write

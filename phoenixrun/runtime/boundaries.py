"""Quiesce boundaries inside a step: where a survivor notices the master's quiesce order and abandons its step.

A survivor that is computing when a quiesce arrives must stop before the new generation can rendezvous: the
rebuild waits for the slowest of them (issue 33 item 2). Before this module the boundaries were the step's
collectives (a DDP gradient bucket: one or two per backward at the example's default size, where every gradient
fits one 25 MB bucket), its forward's start and its optimizer step - so a survivor ran the rest of its forward or
backward first, 0.07-0.7 s at d256 on this machine. Here every submodule's forward and every parameter's gradient
is a boundary too: the step is abandoned within one layer's compute.

The checks are one flag read each (`check` raises `Quiesced` when the generation was told to stop); a step of the
d256 example runs ~20 module forwards and ~30 gradient hooks. Not installed:
  - in the subtree of a torch.compile'd module, for the forward hooks: dynamo would trace the flag into the graph
    (a gradient hook runs in the autograd engine, outside the compiled graph, and stays);
  - under FSDP2 at all (the caller's decision: its own backward hooks keep state that an exception raised between
    them would leave behind for the replay).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle


def compiled_subtrees(model: torch.nn.Module) -> set[int]:
    """The ids of every module inside a torch.compile'd module (its `_orig_mod` and all below it)."""
    inside: set[int] = set()
    for m in model.modules():
        orig = getattr(m, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module):
            inside.update(id(x) for x in orig.modules())
    return inside


def install(model: torch.nn.Module, check: Callable[[str], None]) -> list[RemovableHandle]:
    """A boundary before every submodule's forward (not `model`'s own: the caller has its hook there) and at every
    parameter's gradient. `check(where)` raises to abandon the step. Returns the handles (to remove them)."""
    def before_forward(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        check("a layer's forward")

    def at_gradient(grad: torch.Tensor) -> None:
        check("a gradient")

    skip = compiled_subtrees(model)
    handles: list[RemovableHandle] = []
    for m in model.modules():
        if m is not model and id(m) not in skip:
            handles.append(m.register_forward_pre_hook(before_forward, prepend=True))
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_hook(at_gradient))   # type: ignore[no-untyped-call]  # torch's
    return handles

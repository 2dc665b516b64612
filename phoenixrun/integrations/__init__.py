"""Thin adapters that give the training loops of other libraries hot swap through the public API
(docs/porting.md). Each imports its library only when used; under plain torchrun each behaves as the library does."""
from __future__ import annotations

import torch


def rng_states() -> list[torch.Tensor]:
    """The process's CPU and CUDA RNG states: what a framework's resume must find again after re-entering its
    loop (its own seeding on re-entry would overwrite what the snapshot restored)."""
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if cuda else [])]


def set_rng_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])

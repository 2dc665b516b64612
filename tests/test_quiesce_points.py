"""runtime/boundaries.py: a quiesce that arrives inside a forward or a backward abandons the step at the next layer
or gradient, not at the end of the compute."""
from __future__ import annotations

import pytest
import torch

from phoenixrun.runtime import boundaries


class Stop(RuntimeError):
    pass


class Flag:
    """The quiesce flag, raised by the test at a chosen point; records where the step was abandoned."""

    def __init__(self) -> None:
        self.up = False
        self.where: list[str] = []

    def check(self, where: str) -> None:
        if self.up:
            self.where.append(where)
            raise Stop(where)


class Layers(torch.nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
        self.ran: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            self.ran.append(i)
            x = torch.relu(layer(x))
        return x.sum()


def test_a_quiesce_during_the_forward_stops_at_the_next_layer() -> None:
    model, flag = Layers(), Flag()
    boundaries.install(model, flag.check)
    model.layers[1].register_forward_hook(lambda m, a, out: setattr(flag, "up", True))   # arrives in layer 1
    with pytest.raises(Stop):
        model(torch.randn(2, 8))
    assert model.ran == [0, 1, 2] and flag.where == ["a layer's forward"]   # layer 2 never computed


def test_a_quiesce_during_the_backward_stops_at_the_next_gradient() -> None:
    model, flag = Layers(), Flag()
    boundaries.install(model, flag.check)
    loss = model(torch.randn(2, 8))
    seen: list[str] = []
    last: torch.Tensor = model.layers[3].weight   # type: ignore[assignment]  # ModuleList items are Modules

    def arrive(grad: torch.Tensor) -> None:   # after this tensor's own boundary (registered first): the next raises
        seen.append("layer 3")
        flag.up = True
    last.register_hook(arrive)   # type: ignore[no-untyped-call]  # torch's
    with pytest.raises(Stop):
        loss.backward()
    assert seen == ["layer 3"] and flag.where == ["a gradient"]
    assert model.layers[0].weight.grad is None   # the first layer's gradient was never computed


def test_no_quiesce_changes_nothing() -> None:
    torch.manual_seed(0)
    plain = Layers()
    hooked = Layers()
    hooked.load_state_dict(plain.state_dict())
    boundaries.install(hooked, Flag().check)
    x = torch.randn(2, 8)
    plain(x).backward()
    hooked(x).backward()
    for a, b in zip(plain.parameters(), hooked.parameters()):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_the_caller_s_own_module_and_compiled_subtrees_get_no_forward_hook() -> None:
    inner = Layers()
    compiled: torch.nn.Module = torch.compile(inner, backend="eager")   # type: ignore[assignment]  # a Module
    top = torch.nn.Sequential(compiled, torch.nn.Identity())
    handles = boundaries.install(top, Flag().check)
    hooked = [m for m in top.modules() if m._forward_pre_hooks]
    assert top not in hooked and not any(m in hooked for m in inner.modules())
    assert compiled in hooked and top[1] in hooked
    n_params = sum(1 for p in top.parameters() if p.requires_grad)
    assert len(handles) == len(hooked) + n_params      # every parameter still has its gradient boundary
    for h in handles:
        h.remove()
    assert not [m for m in top.modules() if m._forward_pre_hooks]

"""tunekit.integrations.fold_graph: a norm's readers found from its layer's forward, on stand-in modules."""

from __future__ import annotations

import torch
from torch import nn

from tunekit.integrations import fold_graph


class Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.mode = "plain"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch = hidden_states.shape[0]
        if self.mode == "gated":
            return self.o(torch.sigmoid(hidden_states))  # not taken: the module's mode is "plain"
        return self.o(self.q(hidden_states) * self.k(hidden_states)).view(batch, -1)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_in, self.attn, self.norm_mlp, self.up = Norm(), Attention(), Norm(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(hidden_states=self.norm_in(x)) + x
        y = self.norm_mlp(h)
        return self.up(y) + h


def _find(layer: nn.Module) -> dict[str, fold_graph.NormReaders]:
    names = [n for n, m in layer.named_children() if isinstance(m, Norm)]
    return fold_graph.norm_readers(layer, names, lambda m: isinstance(m, nn.Linear), lambda m: isinstance(m, Norm))


def test_readers_are_the_linears_the_forward_reaches_through_submodules_and_taken_branches() -> None:
    found = _find(Layer())
    assert found["norm_in"] == fold_graph.NormReaders("norm_in", ("attn.q", "attn.k"), None)
    assert found["norm_mlp"] == fold_graph.NormReaders("norm_mlp", ("up",), None)
    model = nn.ModuleList([Layer(), Layer()])
    assert [(p, n) for p, _, n in fold_graph.decoder_layers(model, lambda m: isinstance(m, Norm))] == [
        ("0", ["norm_in", "norm_mlp"]), ("1", ["norm_in", "norm_mlp"])]


def test_a_norm_also_read_by_a_non_linear_or_a_residual_add_is_refused_with_the_reason() -> None:
    layer = Layer()
    layer.attn.mode = "gated"  # the branch with the activation on the normed input is the one taken now
    found = _find(layer)
    assert found["norm_in"].readers == () and found["norm_in"].reason.startswith(fold_graph.OTHER_READER)
    assert "torch.sigmoid(hidden_states)" in found["norm_in"].reason

    class AddsIt(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm_mlp(x)
            return self.up(y) + y

    assert _find(AddsIt())["norm_mlp"].reason.startswith(fold_graph.RESIDUAL_ADD)


def test_a_reader_without_source_or_an_unprovable_flow_refuses() -> None:
    namespace: dict = {}
    exec("def forward(self, hidden_states):\n    return self.q(hidden_states)", namespace)
    layer = Layer()
    layer.attn.__class__ = type("Compiled", (Attention,), {"forward": namespace["forward"]})
    assert _find(layer)["norm_in"].reason.startswith(fold_graph.NO_SOURCE)

    class Loops(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm_mlp(x)
            for _ in range(2):
                x = self.up(y)
            return x

    class Stars(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            args = (self.norm_mlp(x),)
            return self.up(*args)

    class Unused(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x)

    assert _find(Loops())["norm_mlp"].reason.startswith(fold_graph.NOT_PROVEN)
    assert _find(Stars())["norm_mlp"].reason.startswith(fold_graph.NOT_PROVEN)
    assert _find(Unused())["norm_mlp"].reason.startswith(fold_graph.NOT_CALLED)


def test_a_tuple_assignment_binds_each_name_to_its_own_value() -> None:
    class Swaps(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            residual, y = x, self.norm_mlp(x)
            return self.up(y) + residual

    assert _find(Swaps())["norm_mlp"].readers == ("up",)

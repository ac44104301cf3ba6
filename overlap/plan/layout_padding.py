"""What row-aligned shards cost in padding (see [Note: row-aligned shards]): per flat group,
the zero elements of the gathered buffer beyond what plain padding to a multiple of the
world size needs, for a model's units or for shapes alone (Llama-3-8B's below), so the
figure in docs/parameters.md is computed, not estimated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from overlap.base.layout import FlatLayout

Shape = tuple[int, ...]


@dataclass(frozen=True)
class UnitPadding:
    """One flat group's padding in the gathered buffer, in elements and in bytes."""

    name: str
    numel: int
    padding_numel: int           # row-aligned layout: gaps and tail
    plain_padding_numel: int     # padding to a multiple of the world size only
    element_bytes: int

    @property
    def padding_bytes(self) -> int:
        return self.padding_numel * self.element_bytes

    @property
    def extra_bytes(self) -> int:
        """Bytes of padding that row alignment adds to the plain layout's."""
        return (self.padding_numel - self.plain_padding_numel) * self.element_bytes

    @property
    def padding_share(self) -> float:
        return self.padding_numel / max(self.numel, 1)


def unit_padding(name: str, shapes: Sequence[Shape], world: int, element_bytes: int) -> UnitPadding:
    """The padding of one flat group of parameters of `shapes` over `world` ranks."""
    layout = FlatLayout.of(shapes, world)
    plain = -(-max(layout.numel, 1) // world) * world - layout.numel
    return UnitPadding(name, layout.numel, layout.padding_numel, plain, element_bytes)


def llama_layer_shapes(hidden: int = 4096, intermediate: int = 14336, heads: int = 32,
                       kv_heads: int = 8) -> list[Shape]:
    """One Llama decoder layer's parameters in module order (Llama-3-8B by default)."""
    head_dim = hidden // heads
    return [(hidden, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden), (hidden, hidden),
            (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]


def llama_root_shapes(hidden: int = 4096, vocab: int = 128256) -> list[Shape]:
    """The parameters outside the decoder layers: embedding, final norm, untied head."""
    return [(vocab, hidden), (hidden,), (vocab, hidden)]

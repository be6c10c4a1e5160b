"""``LayerGraph``: layers of a model file run in row order, each reading the outputs its row names.

A model YAML lists rows ``[from, repeats, module, args]``; ``models.spec`` builds one
layer per row and splits them into a backbone graph and a neck graph (the head is the
last row). Children are named by their row index in the whole file (``backbone.0``,
``neck.12``, ...), so a state dict in the community naming (``model.<row>.<...>``) maps
onto them by changing the first name only.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

Source = int | tuple[int, ...]


class LayerGraph(nn.Module):
    """Layers run in order; each reads the saved outputs its row names.

    Args:
        layers: ``(row index, module)`` in row order.
        sources: for each layer, the row index (or indices, for a list input) it reads;
            absolute, as the rows of ``inputs`` and earlier layers.
        inputs: row indices of the tensors ``forward`` receives, in order (a backbone: ``(-1,)``,
            the images).
        outputs: row indices whose outputs ``forward`` returns, in order.
        out_channels: channels of each output.
        strides: stride of each output in input pixels.

    Examples:
        >>> graph = LayerGraph([(0, Conv(3, 8, 3, 2))], [-1], inputs=(-1,), outputs=(0,), out_channels=(8,),
        ...                    strides=(2,))
        >>> [y.shape for y in graph(torch.zeros(1, 3, 32, 32))]
        [torch.Size([1, 8, 16, 16])]
    """

    def __init__(self, layers: Sequence[tuple[int, nn.Module]], sources: Sequence[Source], *,
                 inputs: Sequence[int], outputs: Sequence[int], out_channels: Sequence[int], strides: Sequence[int]):
        super().__init__()
        if len(layers) != len(sources):
            raise ValueError(f"{len(layers)} layers but {len(sources)} sources")
        for index, layer in layers:
            self.add_module(str(index), layer)
        self.rows = tuple(index for index, _ in layers)
        self.sources = tuple(s if isinstance(s, int) else tuple(s) for s in sources)
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.out_channels, self.strides = tuple(out_channels), tuple(strides)
        needed = {j for s in self.sources for j in ((s,) if isinstance(s, int) else s)} | set(self.outputs)
        self.kept = tuple(i in needed for i in self.rows)   # outputs a later layer or the caller reads
        known = set(self.inputs)
        for index, source in zip(self.rows, self.sources, strict=True):
            missing = [j for j in ((source,) if isinstance(source, int) else source) if j not in known]
            if missing:
                raise ValueError(f"layer {index} reads {missing}, which is neither an input nor an earlier layer")
            known.add(index)
        if not set(self.outputs) <= known:
            raise ValueError(f"outputs {sorted(set(self.outputs) - known)} are neither inputs nor layers")

    def forward(self, inputs: Tensor | list[Tensor]) -> list[Tensor]:
        """The images (a backbone) or the previous graph's outputs -> the maps of ``outputs``."""
        if isinstance(inputs, Tensor):
            inputs = [inputs]
        saved = dict(zip(self.inputs, inputs, strict=False))   # not strict: compile traces forward
        for layer, index, source, keep in zip(self.children(), self.rows, self.sources, self.kept, strict=False):
            x = layer(saved[source] if isinstance(source, int) else [saved[j] for j in source])
            if keep:
                saved[index] = x
        return [saved[j] for j in self.outputs]

    def checkpoint_units(self) -> list[tuple[str, nn.Module]]:
        """Layers that hold parameters, by child name: the units activation checkpointing may wrap."""
        return [(name, m) for name, m in self.named_children() if any(True for _ in m.parameters())]

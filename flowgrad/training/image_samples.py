"""Images a generative model draws from noise, as a PNG grid:
`flowgrad generate MODEL --checkpoint C --out samples.png [--samples N] [--seed S] [--output NAME]`.

The model draws its noise with `randn_like` (models/gan.flow's generator);
its inputs only size that noise, so they are fed zeros, at the number of
images asked for. That the image output reads no input's values is checked
first, by feeding zeros and ones with the same noise and comparing (a
model that maps its inputs to images, an autoencoder, needs real inputs:
`flowgrad run` feeds them). An output of images is [n, pixels] with pixels
a square (8x8 digits: 64), [n, h, w], or [n, c, h, w] with one or three
channels. Writing the grid needs matplotlib (the `plot` extra)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError


def image_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """(h, w) or (h, w, channels) of one row of an output shaped [n, *shape], else None."""
    if len(shape) == 1 and math.isqrt(shape[0]) ** 2 == shape[0] and shape[0] > 1:
        side = math.isqrt(shape[0])
        return side, side
    if len(shape) == 2:
        return shape
    if len(shape) == 3 and shape[0] in (1, 3):
        return shape[1:] if shape[0] == 1 else (*shape[1:], 3)
    return None


def image_output(graph, name: str | None = None) -> str:
    """The output that holds images (the one named, else the first that is
    shaped as images and is no objective's loss)."""
    losses = graph.loss_ids()
    images = [n for n, i in graph.outputs.items()
              if i not in losses and image_shape(graph.nodes[i].shape[1:]) is not None]
    if name is not None:
        if name not in graph.outputs:
            raise FlowError(f"--output {name}: not an output of {graph.name} (outputs: {', '.join(graph.outputs)})")
        if name not in images:
            raise FlowError(f"--output {name}: {graph.nodes[graph.outputs[name]].type} is no batch of images "
                            "([n, pixels] with a square number of pixels, [n, h, w], or [n, 1 or 3, h, w])")
        return name
    if not images:
        have = ", ".join(f"{n}: {graph.nodes[i].type}" for n, i in graph.outputs.items()) or "none"
        raise FlowError(f"{graph.name} has no output of images to sample (outputs: {have})",
                        hint="declare the generated images as an output: `output fake`, shaped [batch, pixels] "
                             "with a square number of pixels, [batch, h, w] or [batch, channels, h, w]")
    return images[0]


def zero_feeds(graph, n: int, fill: float = 0.0) -> dict[str, np.ndarray]:
    """Every input at n rows, all `fill`."""
    return {name: np.full((n, *graph.nodes[i].shape[1:]), fill, NUMPY_DTYPE[graph.nodes[i].dtype])
            for name, i in graph.inputs.items()}


def sample_images(sess, n: int = 64, output: str | None = None, seed: int = 0) -> np.ndarray:
    """n images the model draws from the noise of `seed`: [n, h, w] or [n, h, w, 3]."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise FlowError(f"the number of samples must be at least 1, got {n!r}")
    graph = sess.graph
    name = image_output(graph, output)
    drawn = sess.predict(zero_feeds(graph, n), outputs=[name], seed=seed)[name]
    if graph.inputs:
        other = sess.predict(zero_feeds(graph, n, 1.0), outputs=[name], seed=seed)[name]
        if not np.allclose(drawn, other, rtol=1e-4, atol=1e-5):
            raise FlowError(f"output {name} of {graph.name} depends on the values of its inputs "
                            f"({', '.join(graph.inputs)}), not only on the noise it draws: generate samples "
                            "images from noise alone", hint="feed real inputs with `flowgrad run ... --out "
                                                            "images.npy`")
    shape = image_shape(drawn.shape[1:])
    if len(shape) == 3 and drawn.ndim == 4:   # [n, 3, h, w] -> [n, h, w, 3]
        return np.moveaxis(drawn, 1, -1)
    return drawn.reshape(n, *shape)


def write_grid(images: np.ndarray, path, columns: int | None = None) -> None:
    """The images in a grid, light on dark as the values run 0 to 1 (the
    images' own range where they leave it), as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise FlowError("writing images needs matplotlib: pip install 'flowgrad[plot]'") from None
    n = len(images)
    cols = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    low, high = float(np.nanmin(images)), float(np.nanmax(images))
    low, high = (0.0, 1.0) if low >= 0 and high <= 1 else (low, high)
    fig = Figure(figsize=(cols * 0.6, rows * 0.6), dpi=100)
    FigureCanvasAgg(fig)
    for k in range(rows * cols):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.axis("off")
        if k < n:
            ax.imshow(images[k], cmap="gray", vmin=low, vmax=high, interpolation="nearest")
    fig.subplots_adjust(0.02, 0.02, 0.98, 0.98, 0.08, 0.08)
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None

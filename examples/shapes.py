"""A small image-classification dataset MaTEx makes itself (no downloads).

16x16 grayscale images of four shapes (square, disc, triangle, cross) at
random positions and sizes, with noise. Deterministic for a given seed.
"""

import numpy as np

CLASSES = ("square", "disc", "triangle", "cross")


def make_shapes(n, seed=0, size=16):
    """Return ``(images float32 [n, size, size, 1], labels int64 [n])``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    images = np.empty((n, size, size, 1), np.float32)
    labels = rng.integers(0, len(CLASSES), size=n)
    for i, label in enumerate(labels):
        r = rng.uniform(3, 6)
        cy, cx = rng.uniform(r, size - r, size=2)
        dy, dx = yy - cy, xx - cx
        if label == 0:
            mask = (np.abs(dy) <= r * 0.8) & (np.abs(dx) <= r * 0.8)
        elif label == 1:
            mask = dy ** 2 + dx ** 2 <= r ** 2
        elif label == 2:
            mask = (dy <= r * 0.8) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.55)
        else:
            mask = ((np.abs(dy) <= 1) | (np.abs(dx) <= 1)) & (np.abs(dy) <= r) & (np.abs(dx) <= r)
        img = mask.astype(np.float32) * rng.uniform(0.6, 1.0)
        images[i, :, :, 0] = img + rng.normal(0, 0.15, size=(size, size))
    return images, labels.astype(np.int64)

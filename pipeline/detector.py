"""Classical detector for ShapesWorld images (rendered or generated).

Per image, in four steps:
1. Pixel model: every pixel is taken as a blend a * c + (1 - a) * background of one palette
   color c. For each color the blend weight a is the projection of (pixel - background) on
   (c - background), clipped to [0, 1]; the color with the smallest residual wins and gives the
   pixel's alpha. This is what anti-aliased or blurred edges look like, so soft edges do not
   change the color.
2. Objects: 8-connected components of alpha > 0.5; components under `min_area` pixels are
   specks and are dropped.
3. Color: the component's mean pixel fitted by the same blend model with a in [0.5, 1.2].
4. Shape: the component's soft alpha (along its color) is compared with anti-aliased templates
   of each shape of the same area and centroid (both preserved by blur) over a grid of
   rotations, sharp and blurred by `BLUR_SIGMAS`; soft IoU = sum(min) / sum(max). The best
   shape is the class, its IoU the score (clean renders score 0.93-0.99).
Detections with score < `min_score` are dropped.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import torch
from scipy import ndimage

from pipeline.geneval import Detection
from pipeline.world import BACKGROUND, COLORS, SHAPES, SYMMETRY, shape_area, shape_coverage

MIN_AREA = 8  # px; smaller components are noise specks
MIN_SCORE = 0.5  # soft IoU below this is not a shape of the world
ROTATION_STEP = np.deg2rad(5.0)
BLUR_SIGMAS = (0.7, 1.4)  # px; templates are also matched blurred, as generated edges are soft
_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)
_PALETTE = np.asarray(list(COLORS.values()), dtype=np.float64)  # (K, 3)
_COLOR_NAMES = tuple(COLORS)
_DIRECTIONS = _PALETTE - np.asarray(BACKGROUND)  # (K, 3) background -> color
_DIR_NORM2 = (_DIRECTIONS**2).sum(axis=1)  # (K,)


def _blend_fit(pixels: np.ndarray, a_min: float, a_max: float) -> tuple[np.ndarray, np.ndarray]:
    """Fit each pixel as background + a * (color - background) for every palette color.

    pixels: (..., 3). Returns (alpha, residual), both (..., K): the clipped blend weight and
    the distance of the pixel from the fitted blend.
    """
    diff = pixels - np.asarray(BACKGROUND)  # (..., 3)
    alpha = np.clip(diff @ _DIRECTIONS.T / _DIR_NORM2, a_min, a_max)  # (..., K)
    fitted = alpha[..., None] * _DIRECTIONS  # (..., K, 3)
    residual = np.linalg.norm(diff[..., None, :] - fitted, axis=-1)  # (..., K)
    return alpha, residual


def _to_hwc(image: np.ndarray | torch.Tensor) -> np.ndarray:
    """(H, W, 3) array or (3, H, W) tensor/array in [0, 1] -> (H, W, 3) float64."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().float().numpy()
    image = np.asarray(image, dtype=np.float64)
    if image.ndim != 3 or 3 not in (image.shape[0], image.shape[-1]):
        raise ValueError(f"expected an (H, W, 3) or (3, H, W) image, got shape {image.shape}")
    return image if image.shape[-1] == 3 else image.transpose(1, 2, 0)


def detect(
    image: np.ndarray | torch.Tensor,
    *,
    shapes: Sequence[str] = SHAPES,
    min_area: int = MIN_AREA,
    min_score: float = MIN_SCORE,
) -> dict[str, list[Detection]]:
    """Detect the shapes in one image (module docstring).

    image: (H, W, 3) array or (3, H, W) tensor, float in [0, 1].
    Returns {class: detections sorted by score, highest first} with every class in `shapes`
    present (possibly empty); boxes (x0, y0, x1, y1) are pixel-edge extents of the mask.
    """
    pixels = _to_hwc(image)
    alpha_all, residual_all = _blend_fit(pixels, 0.0, 1.0)  # (H, W, K)
    best = residual_all.argmin(axis=-1)  # (H, W)
    alpha = np.take_along_axis(alpha_all, best[..., None], axis=-1)[..., 0]  # (H, W)
    labels, n = ndimage.label(alpha > 0.5, structure=_EIGHT_CONNECTED)
    found: dict[str, list[Detection]] = {name: [] for name in shapes}
    for index, window in enumerate(ndimage.find_objects(labels), start=1):
        mask = labels == index
        if mask.sum() < min_area:
            continue
        color = _component_color(pixels[mask])
        soft = _soft_alpha(pixels, labels, index, window, color)
        name, score = _classify(soft, shapes)
        if score < min_score:
            continue
        rows, cols = window
        box = (float(cols.start), float(rows.start), float(cols.stop), float(rows.stop))
        found[name].append(Detection(box=box, score=score, color=_COLOR_NAMES[color], mask=mask))
    for dets in found.values():
        dets.sort(key=lambda d: -d.score)
    return found


def detect_batch(
    images: torch.Tensor, *, workers: int = 1, **kwargs
) -> list[dict[str, list[Detection]]]:
    """`detect` on each image of a (B, 3, H, W) batch in [0, 1].

    The detector is single-threaded numpy, so with `workers` > 1 a batch of at least
    `PARALLEL_MIN_IMAGES` is split over that many worker processes (started once per process,
    by spawn: no fork of a process that runs torch threads). Same detections either way.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected (B, 3, H, W) images, got shape {tuple(images.shape)}")
    # Contiguous, as a worker receives it: numpy's sums depend on the memory layout in the
    # last bits, and the detections must not depend on where they were computed.
    array = np.ascontiguousarray(images.detach().cpu().float().numpy().transpose(0, 2, 3, 1))
    if workers > 1 and len(array) >= PARALLEL_MIN_IMAGES and workers not in _BROKEN:
        chunks = np.array_split(array, workers)
        try:
            found = list(_pool(workers).map(functools.partial(_detect_each, **kwargs), chunks))
        except BrokenProcessPool:
            # Spawned workers re-import the main script: one that runs its work at import (no
            # `if __name__ == "__main__":`) kills them. Detect here instead, and say so once.
            _BROKEN.add(workers)
            warnings.warn(
                "detector worker processes could not start (does the main script lack an "
                "`if __name__ == '__main__':` guard?); detecting in this process",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            return [detections for chunk in found for detections in chunk]
    return _detect_each(array, **kwargs)


PARALLEL_MIN_IMAGES = 32  # smaller batches cost less than handing them to the workers
_BROKEN: set[int] = set()  # worker counts whose pool could not start in this process


def _detect_each(array: np.ndarray, **kwargs) -> list[dict[str, list[Detection]]]:
    return [detect(im, **kwargs) for im in array]


@functools.cache
def _pool(workers: int) -> ProcessPoolExecutor:
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    atexit.register(pool.shutdown, cancel_futures=True)
    return pool


def _component_color(pixels: np.ndarray) -> int:
    """Palette index of a component from its mean pixel (pixels: (N, 3))."""
    _, residual = _blend_fit(pixels.mean(axis=0), 0.5, 1.2)  # (K,)
    return int(residual.argmin())


def _soft_alpha(pixels, labels, index, window, color: int) -> np.ndarray:
    """The component's alpha along its color, in its window padded by 2 px, with pixels of
    other components zeroed: (h, w)."""
    height, width = labels.shape
    rows, cols = window
    r0, r1 = max(rows.start - 2, 0), min(rows.stop + 2, height)
    c0, c1 = max(cols.start - 2, 0), min(cols.stop + 2, width)
    diff = pixels[r0:r1, c0:c1] - np.asarray(BACKGROUND)  # (h, w, 3)
    soft = np.clip(diff @ _DIRECTIONS[color] / _DIR_NORM2[color], 0.0, 1.0)  # (h, w)
    near = ndimage.binary_dilation(labels[r0:r1, c0:c1] == index, _EIGHT_CONNECTED, iterations=2)
    crop_labels = labels[r0:r1, c0:c1]
    soft[~near | ((crop_labels != 0) & (crop_labels != index))] = 0.0
    return soft


def _classify(soft: np.ndarray, shapes: Sequence[str]) -> tuple[str, float]:
    """Best-matching shape and its soft IoU for a soft mask `soft` (h, w)."""
    area = soft.sum()
    rows, cols = np.indices(soft.shape) + 0.5  # pixel centres, (h, w) each
    dy, dx = rows - (soft * rows).sum() / area, cols - (soft * cols).sum() / area
    blurs = [(_blur_matrix(s, soft.shape[0]), _blur_matrix(s, soft.shape[1])) for s in BLUR_SIGMAS]
    best_iou = []
    for name in shapes:
        size = np.sqrt(area / shape_area(name, 1.0))
        angles = np.arange(0.0, max(SYMMETRY[name], ROTATION_STEP), ROTATION_STEP)[
            :, None, None
        ]  # (R, 1, 1)
        sharp = shape_coverage(name, dx, dy, size, angles)  # (R, h, w)
        template = np.concatenate(
            [sharp] + [along_rows @ sharp @ along_cols.T for along_rows, along_cols in blurs]
        )  # (R * (1 + len(BLUR_SIGMAS)), h, w)
        iou = np.minimum(template, soft).sum((1, 2)) / np.maximum(template, soft).sum((1, 2))
        best_iou.append(iou.max())
    best = int(np.argmax(best_iou))  # the first of equals, as shapes are listed
    return shapes[best], float(best_iou[best])


@functools.cache
def _blur_matrix(sigma: float, n: int) -> np.ndarray:
    """(n, n) matrix of a 1-D Gaussian blur of n pixels with zero padding: what
    `scipy.ndimage.gaussian_filter1d(..., mode="constant")` computes (kernel truncated at 4
    sigma), as one matrix so that a stack of templates is blurred by two matmuls instead of
    two filter calls per axis and sigma. Row i holds the weights of pixel i's blurred value."""
    radius = int(4.0 * sigma + 0.5)
    taps = np.exp(-0.5 * np.arange(-radius, radius + 1) ** 2 / sigma**2)
    taps /= taps.sum()
    offset = np.arange(n)[None, :] - np.arange(n)[:, None]  # (n, n): j - i
    return np.where(np.abs(offset) <= radius, taps[np.clip(offset + radius, 0, 2 * radius)], 0.0)

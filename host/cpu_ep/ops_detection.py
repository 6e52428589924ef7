"""NonMaxSuppression: greedy per-class box selection by score, suppressing boxes whose IoU with an
already selected box exceeds the threshold (the order and tie rules of onnx's reference and onnxruntime:
highest score first, the lower box index first among equal scores)."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


def _scalar(x: np.ndarray | None, default):
    return default if x is None or x.size == 0 else x.reshape(-1)[0].item()


@register("NonMaxSuppression", since=10)
class NonMaxSuppression(OpKernel):
    """selected_indices (num_selected, 3): [batch, class, box] rows, per batch then per class."""

    def __init__(self, node):
        super().__init__(node)
        self.center_point_box = self.attr_int("center_point_box", 0, lo=0, hi=1)

    def _corners(self, boxes: np.ndarray) -> np.ndarray:
        """(..., 4) boxes as [y_min, x_min, y_max, x_max] (corner order given either way round)."""
        b = boxes.astype(np.float64)
        if self.center_point_box:
            xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2] / 2, b[..., 3] / 2
            return np.stack([yc - h, xc - w, yc + h, xc + w], axis=-1)
        return np.stack([np.minimum(b[..., 0], b[..., 2]), np.minimum(b[..., 1], b[..., 3]),
                         np.maximum(b[..., 0], b[..., 2]), np.maximum(b[..., 1], b[..., 3])], axis=-1)

    def _run(self, boxes, scores, max_output=None, iou_threshold=None, score_threshold=None):
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[0] != boxes.shape[0] \
                or scores.shape[2] != boxes.shape[1]:
            raise InvalidArgument(f"NonMaxSuppression: boxes must be (batch, boxes, 4) and scores (batch, classes, "
                                  f"boxes); got {list(boxes.shape)} and {list(scores.shape)}")
        limit = max(int(_scalar(max_output, 0)), 0)
        iou = float(_scalar(iou_threshold, 0.0))
        threshold = _scalar(score_threshold, None)
        corners = self._corners(boxes)
        areas = (corners[..., 2] - corners[..., 0]) * (corners[..., 3] - corners[..., 1])
        rows = []
        for b in range(scores.shape[0]):
            for c in range(scores.shape[1]):
                for box in self._select(corners[b], areas[b], scores[b, c], limit, iou, threshold):
                    rows.append((b, c, box))
        return (np.array(rows, dtype=np.int64).reshape(-1, 3),)

    @staticmethod
    def _select(corners, areas, scores, limit: int, iou: float, threshold) -> list[int]:
        order = np.argsort(-scores.astype(np.float64), kind="stable")
        if threshold is not None:
            order = order[scores[order] > threshold]
        chosen: list[int] = []
        for i in order:
            if len(chosen) >= limit:
                break
            if chosen:
                other = corners[chosen]
                h = np.minimum(corners[i, 2], other[:, 2]) - np.maximum(corners[i, 0], other[:, 0])
                w = np.minimum(corners[i, 3], other[:, 3]) - np.maximum(corners[i, 1], other[:, 1])
                inter = np.where((h > 0) & (w > 0), h * w, 0.0)
                union = areas[i] + areas[chosen] - inter
                valid = (inter > 0) & (areas[i] > 0) & (areas[chosen] > 0) & (union > 0)
                ratio = np.divide(inter, union, out=np.zeros_like(inter), where=valid)
                if np.any(valid & (ratio > iou)):
                    continue
            chosen.append(int(i))
        return chosen

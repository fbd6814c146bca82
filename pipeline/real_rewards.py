"""Real-image reward models through transformers, loaded from local directories.

- ``ClipScorer``: PickScore / CLIPScore-style text-image alignment (Kirstain et al. 2023,
  PickScore, Sec. 4: s(x, c) = exp(t) · <E_img(x), E_txt(c)> with unit-norm embeddings and
  CLIP's learned temperature t). Any ``CLIPModel`` directory with its processor works
  (PickScore_v1, openai/clip-vit-large-patch14, ...).
- ``GenEvalDetector``: GenEval's object detection and colour step (Ghosh et al. 2023,
  ``evaluation/evaluate_images.py``) with an open-vocabulary detector, OWLv2 (Minderer et al.
  2023), in place of GenEval's mmdet Mask2Former; its output feeds ``pipeline.geneval``.

GenEval's detection recipe, kept here:
1. per class, detections with confidence > 0.3 (> 0.9 for ``counting`` prompts), highest first,
   at most 16; optional greedy same-class suppression at IoU >= ``nms_iou`` (GenEval's
   ``max_overlap``, off by default), IoU with GenEval's inclusive-pixel (+1) box areas;
2. colour of each object a colour clause checks (the clause's top ``count``): the object pasted on
   a #999999 background through its mask (boxes-only detectors such as OWLv2 give no mask, and
   GenEval then uses the image itself), cropped to its box, and classified zero-shot by CLIP
   over GenEval's ten colours; each colour's text embedding is the renormalised mean of three
   templates' unit embeddings (open_clip's ``zero_shot_classifier``).

OWLv2 assigns each predicted box the query of highest sigmoid score, so the queries act as a
closed vocabulary: GenEval's 80 object names, plus any class a metadata line names outside it.
Images arrive as (B, 3, H, W) fp32 in [0, 1] and are quantised to 8-bit RGB first, as the saved
PNGs that GenEval and PickScore read would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from pipeline.geneval import Detection

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = (
    "a photo of a {color} {name}",
    "a photo of a {color}-colored {name}",
    "a photo of a {color} object",
)
BACKGROUND = (0x99, 0x99, 0x99)  # GenEval's "#999"
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
QUERY_TEMPLATE = "a photo of a {name}"  # OWL-ViT's prompt for a text query
# GenEval's evaluation/object_names.txt: the COCO classes with its renamings.
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip


def to_uint8(images: Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, rounded (an 8-bit image file)."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)


def _features(output) -> Tensor:
    """Projected embeddings of ``get_*_features`` (a tensor before transformers 5, an output
    object holding them in ``pooler_output`` from 5 on)."""
    return output if isinstance(output, Tensor) else output.pooler_output


def _unit(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1)


# ---- CLIP score ------------------------------------------------------------------------------
class ClipScorer:
    """exp(t) · cos(image, prompt) per image (module docstring), (B,) fp32.

    model: a ``CLIPModel``; processor: its ``CLIPProcessor``; batch_size: images per forward.
    """

    def __init__(self, model, processor, *, batch_size: int):
        self.model = model.eval()
        self.processor = processor
        self.batch_size = batch_size

    @property
    def device(self) -> torch.device:
        return self.model.logit_scale.device

    @torch.no_grad()
    def image_embeds(self, pixels: Sequence[np.ndarray]) -> Tensor:
        """N uint8 (h, w, 3) arrays (any sizes) -> (N, D) unit-norm fp32, via the processor."""
        pil = [Image.fromarray(p) for p in pixels]
        inputs = self.processor(images=pil, return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.model.dtype)
        return _unit(_features(self.model.get_image_features(pixel_values=pixel_values)))

    @torch.no_grad()
    def text_embeds(self, texts: Sequence[str]) -> Tensor:
        """N strings -> (N, D) unit-norm fp32 (truncated to the text model's positions)."""
        tokens = self.processor(
            text=list(texts),
            padding=True,
            truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings,
            return_tensors="pt",
        )
        features = self.model.get_text_features(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
        )
        return _unit(_features(features))

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """images (B, 3, H, W) in [0, 1], B prompts -> (B,) fp32 scaled cosine similarities."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        pixels = to_uint8(images)
        scale = self.model.logit_scale.exp().float()
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            stop = start + self.batch_size
            cos = self.image_embeds(pixels[start:stop]) * self.text_embeds(prompts[start:stop])
            scores.append((scale * cos.sum(dim=-1)).cpu())
        return torch.cat(scores)


# ---- GenEval detection -----------------------------------------------------------------------
def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of (x0, y0, x1, y1) boxes with GenEval's inclusive-pixel areas (w = x1 - x0 + 1)."""

    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select_detections(
    scores: np.ndarray,
    labels: np.ndarray,
    boxes: np.ndarray,
    classes: Sequence[str],
    *,
    threshold: float,
    max_objects: int = MAX_OBJECTS,
    nms_iou: float = 1.0,
) -> dict[str, list[Detection]]:
    """GenEval's per-class selection of one image's raw detections.

    scores (M,) in [0, 1], labels (M,) int indices into ``classes``, boxes (M, 4) pixel
    (x0, y0, x1, y1). Per class: keep score > threshold, sort descending, keep the first
    ``max_objects``, then greedily drop boxes whose IoU with a kept one is >= ``nms_iou``
    (1 = keep all, GenEval's default). Returns {class: detections, highest first}; classes
    without detections are absent.
    """
    found: dict[str, list[Detection]] = {}
    for index, name in enumerate(classes):
        rows = np.flatnonzero((labels == index) & (scores > threshold))
        order = rows[np.argsort(-scores[rows], kind="stable")][:max_objects].tolist()
        kept: list[Detection] = []
        while order:
            best = order.pop(0)
            kept.append(
                Detection(box=tuple(float(v) for v in boxes[best]), score=float(scores[best]))
            )
            if nms_iou < 1.0:
                order = [i for i in order if box_iou(boxes[best], boxes[i]) < nms_iou]
        if kept:
            found[name] = kept
    return found


def object_crop(image: np.ndarray, box: Sequence[float], mask: np.ndarray | None) -> np.ndarray:
    """The object as GenEval's colour classifier sees it: (H, W, 3) uint8 -> (h, w, 3) uint8.

    With a mask (H, W) bool, pixels outside it become #999999; the image is then cropped to
    ``box`` rounded to whole pixels as PIL's ``crop`` rounds it, clamped to the image and at
    least one pixel wide and high.
    """
    if mask is not None:
        image = np.where(mask[..., None], image, np.asarray(BACKGROUND, dtype=np.uint8))
    height, width = image.shape[:2]
    x0, y0, x1, y1 = (round(float(v)) for v in box[:4])
    x0, y0 = min(max(x0, 0), width - 1), min(max(y0, 0), height - 1)
    x1, y1 = min(max(x1, x0 + 1), width), min(max(y1, y0 + 1), height)
    return image[y0:y1, x0:x1]


class ColorClassifier:
    """CLIP zero-shot colour of object crops over GenEval's ten colours (module docstring)."""

    def __init__(self, clip: ClipScorer):
        self.clip = clip
        self._weights: dict[str, Tensor] = {}

    def class_weights(self, name: str) -> Tensor:
        """(10, D) unit-norm colour embeddings for objects of class ``name`` (cached)."""
        if name not in self._weights:
            texts = [t.format(color=c, name=name) for c in COLORS for t in COLOR_TEMPLATES]
            per_template = self.clip.text_embeds(texts).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            self._weights[name] = _unit(per_template.mean(dim=1))  # (10, D)
        return self._weights[name]

    def __call__(self, crops: Sequence[np.ndarray], names: Sequence[str]) -> list[str]:
        """N crops (h, w, 3) uint8 of objects of classes ``names`` -> N colour names."""
        colors: list[str] = []
        size = self.clip.batch_size
        for start in range(0, len(crops), size):
            features = self.clip.image_embeds(crops[start : start + size])  # (n, D)
            for feature, name in zip(features, names[start : start + size], strict=True):
                colors.append(COLORS[int((self.class_weights(name) @ feature).argmax())])
        return colors


class OwlDetector:
    """OWLv2 with text queries: images -> per image raw (scores, labels, boxes) in pixels."""

    def __init__(self, model, processor, *, batch_size: int):
        self.model = model.eval()
        self.processor = processor
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(
        self, pixels: np.ndarray, classes: Sequence[str]
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """pixels (B, H, W, 3) uint8 -> B tuples: scores (M,), labels (M,), boxes (M, 4).

        A box's score is its best query's sigmoid probability and its label that query. OWLv2
        pads each image to a square of side max(H, W) (bottom/right) before predicting boxes
        (cx, cy, w, h) relative to that square, so boxes scale by that side, clipped to the image.
        """
        queries = [QUERY_TEMPLATE.format(name=name) for name in classes]
        height, width = pixels.shape[1:3]
        side = max(height, width)
        device = next(self.model.parameters()).device
        results = []
        for start in range(0, len(pixels), self.batch_size):
            chunk = [Image.fromarray(p) for p in pixels[start : start + self.batch_size]]
            inputs = self.processor(
                text=[queries] * len(chunk),
                images=chunk,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            ).to(device)
            out = self.model(**inputs)
            best = out.logits.float().sigmoid().max(dim=-1)  # over queries: (b, M)
            cx, cy, w, h = (out.pred_boxes.float() * side).unbind(-1)  # each (b, M)
            boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)
            limits = torch.tensor([width, height, width, height], device=boxes.device)
            boxes = torch.minimum(boxes.clamp_min(0), limits)  # (b, M, 4)
            for i in range(len(chunk)):
                results.append(
                    (
                        best.values[i].cpu().numpy(),
                        best.indices[i].cpu().numpy(),
                        boxes[i].cpu().numpy(),
                    )
                )
        return results


def query_classes(metadata: Sequence[Mapping]) -> list[str]:
    """GenEval's 80 classes, then any class the metadata names outside them (first seen)."""
    named = [c["class"] for m in metadata for c in (*m.get("include", []), *m.get("exclude", []))]
    return list(dict.fromkeys([*GENEVAL_CLASSES, *named]))


class GenEvalDetector:
    """Detections per image in the form ``pipeline.geneval.evaluate`` judges (module docstring).

    detector: (pixels (B, H, W, 3) uint8, classes) -> raw detections (``OwlDetector``);
    colors: (crops, class names) -> colour names (``ColorClassifier``).
    """

    def __init__(self, detector, colors, *, nms_iou: float = 1.0):
        self.detector = detector
        self.colors = colors
        self.nms_iou = nms_iou

    def __call__(
        self, images: Tensor, metadata: Sequence[Mapping]
    ) -> list[dict[str, list[Detection]]]:
        """images (B, 3, H, W) in [0, 1] + B GenEval metadata lines -> B {class: detections}."""
        if len(metadata) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(metadata)} metadata lines")
        pixels = to_uint8(images)
        classes = query_classes(metadata)
        found = [
            select_detections(
                *raw,
                classes,
                threshold=COUNTING_THRESHOLD if meta.get("tag") == "counting" else THRESHOLD,
                max_objects=MAX_OBJECTS,
                nms_iou=self.nms_iou,
            )
            for raw, meta in zip(self.detector(pixels, classes), metadata, strict=True)
        ]
        self._classify_colors(pixels, metadata, found)
        return found

    def _classify_colors(self, pixels, metadata, found) -> None:
        """Set ``color`` on the top-``count`` objects of every colour clause, in one batch."""
        jobs: dict[tuple[int, str, int], Detection] = {}
        for i, meta in enumerate(metadata):
            for clause in meta.get("include", []):
                if "color" in clause:
                    objects = found[i].get(clause["class"], [])[: clause["count"]]
                    for k, det in enumerate(objects):
                        jobs[(i, clause["class"], k)] = det
        if not jobs:
            return
        crops = [object_crop(pixels[i], det.box, det.mask) for (i, _, _), det in jobs.items()]
        names = [name for _, name, _ in jobs]
        for det, color in zip(jobs.values(), self.colors(crops, names), strict=True):
            det.color = color


# ---- loading ---------------------------------------------------------------------------------
def load_clip(path: Path, *, device: str, batch_size: int) -> ClipScorer:
    """A ``CLIPModel`` + ``CLIPProcessor`` directory (local files only), fp32 on ``device``."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(path, local_files_only=True).to(device)
    processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
    return ClipScorer(model, processor, batch_size=batch_size)


def load_owlv2(path: Path, *, device: str, batch_size: int) -> OwlDetector:
    """An ``Owlv2ForObjectDetection`` + processor directory (local files only), fp32."""
    from transformers import Owlv2ForObjectDetection, Owlv2Processor

    model = Owlv2ForObjectDetection.from_pretrained(path, local_files_only=True).to(device)
    processor = Owlv2Processor.from_pretrained(path, local_files_only=True)
    return OwlDetector(model, processor, batch_size=batch_size)

"""ShapesCLIP: a small contrastive text-image model of ShapesWorld, used as a smooth reward.

The score is CLIP's scaled cosine similarity, score = exp(t) * cos(f_img(x), f_txt(y))
(Radford et al. 2021, CLIP, Fig. 3 pseudo-code; t = `logit_scale`, exp(t) clamped at 100),
the way PickScore and CLIPScore score real images.

Towers:
- text: transformers' `CLIPTextModelWithProjection` with a tiny `CLIPTextConfig` and a
  word-level tokenizer over the world's vocabulary (`tokenizers` WordLevel wrapped in
  `PreTrainedTokenizerFast`); pooled at [EOS], as CLIP does.
- image: a small convolutional encoder, not CLIP's ViT. Measured on ShapesWorld (64 images a
  step, AdamW 1e-3, 300 steps, supervised shape classification): a 2-layer CLIP ViT
  (patch 4, width 64) stays near chance (0.44), also with max pooling or a conv stem in
  front (0.5-0.7), while this encoder reaches 1.0 within 200 steps. Average pooling is the
  culprit (a small object is a few tokens among 64); so the encoder pools with both max
  (which object kinds are present) and mean (how many), and every conv sees two coordinate
  channels (CoordConv, Liu et al. 2018) so that positions survive the pooling.
Files in the model directory: `text/` (`save_pretrained` of the text tower and tokenizer),
`image.safetensors` (image tower and logit scale), `shapesclip.json` (image tower config).

Training (`train_shapesclip`) draws fresh scenes every step. Per caption i of a batch of B:
its render x_i plus K hard negatives (renders of `world.corrupt` scenes: missing or extra
object, wrong class, wrong or swapped colors, swapped relation). Both directions use
multi-positive InfoNCE with targets from the exact scene contents: caption i matches image j
when GenEval's rules accept the scene of j for caption i (so "a photo of a circle" matches a
red circle next to a blue square), S[i, j] in {0, 1}.
- text -> image: softmax over the B renders and caption i's own K negatives, target
  S[i, :] / sum(S[i, :]) (other captions' negatives are left out: they may match caption i);
- image -> text: softmax over the B captions for each render j, target S[:, j] / sum(S[:, j]).
- hard negatives alone: softmax over caption i's own render and its K negatives, target the
  render (the ranking the reward must get right, diluted among B renders in the first term;
  NegCLIP, Yuksekgonul et al. 2023, adds such negatives on the text side).
- shared attribute head (auxiliary, `attribute_weight`): one cosine classifier reads both
  unit-norm embeddings and predicts what a render contains (`scene_attributes`: which
  class-color pairs, how many of each class, which class stands in which relation to which)
  and what a caption states (`caption_attributes`, the same layout, masked to what it says).
  Both towers start from scratch; with the contrastive loss alone, or with a plain linear
  attribute head, all captions of one template stay embedded alike for hundreds of steps
  (cos > 0.99 between "a red circle" and "a blue circle"). Measured after 600 steps, held-out
  wrong-color negatives ranked right 0.56 (no head) -> 0.98 (shared cosine head), swapped
  relations 0.50 -> 0.69. The head is dropped after training.
- text-side hard negatives (`text_negative_loss`): for colors, position and color_attr
  captions, the caption of a wrong color, the opposite relation or the swapped colors must
  score below the right caption on the caption's own render.
Loss = mean of the first two cross-entropies + the third + the text-side term + the
auxiliary losses. The first
negative of a caption is of a kind its tag is about (`FOCUS_KINDS`). Images are
degraded (`world.degrade`: blur, noise, color offsets) so that generated images are scored too.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from pipeline import world
from pipeline.geneval import RELATIONS, Detection, evaluate, relative_position

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}
MAX_TOKENS = 16  # longest prompt: 10 words + [BOS] + [EOS]
TEMPLATE_WORDS = ("a", "an", "photo", "of", "and", "left", "right", "above", "below")
INIT_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature


def build_tokenizer():
    """Word-level tokenizer over ShapesWorld's vocabulary (every shape, color, number word).

    Lower-cases, splits on whitespace, wraps a prompt as [BOS] words [EOS]; unknown words map
    to [UNK]. Returns a `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIAL_TOKENS.values(), *TEMPLATE_WORDS, *world.NUMBER_WORDS, *world.COLORS]
    for shape in world.SHAPE_NAMES:
        words += [shape, world.plural(shape)]
    vocab = {word: i for i, word in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, eos = SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_max_length=MAX_TOKENS,
        **{f"{name}_token": token for name, token in SPECIAL_TOKENS.items()},
    )


def build_text_config(
    tokenizer, *, hidden: int = 64, layers: int = 2, heads: int = 4, embed_dim: int = 64
):
    """A tiny `CLIPTextConfig`: width `hidden`, depth `layers`, MLP width 2 * hidden, output
    projection to `embed_dim`."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=embed_dim,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # CLIP pools the text at the first [EOS]
    )


def _with_coordinates(x: Tensor) -> Tensor:
    """Append x and y coordinate channels in [-1, 1]: (B, C, H, W) -> (B, C + 2, H, W)."""
    b, _, h, w = x.shape
    ys, xs = torch.meshgrid(
        torch.linspace(-1, 1, h, device=x.device),
        torch.linspace(-1, 1, w, device=x.device),
        indexing="ij",
    )
    return torch.cat([x, torch.stack([xs, ys]).expand(b, 2, h, w)], dim=1)


class ImageEncoder(nn.Module):
    """Conv encoder: (B, 3, H, W) in [0, 1] -> (B, embed_dim) (unnormalized).

    image * 2 - 1 -> conv3x3(width) -> conv3x3(width) -> maxpool 2 -> conv3x3(2 width) ->
    maxpool 2 -> conv3x3(2 width) = features F (B, 2 width, H/4, W/4). GELU after every conv
    and hidden layer; every conv also sees the pixel coordinates (CoordConv), so that a late
    feature can be "circle, far left" and survive the pooling. Pooled over space:
    - max and mean of F (4 width): which kinds of object are there, and how much of them;
    - factored bilinear max (Lin et al. 2015, bilinear CNNs): a softmax over `color_factors`
      (1x1 conv of F) times `shape_factors` GELU features (1x1 conv of F), outer product per
      location, max over locations (color_factors * shape_factors). It keeps "red circle and
      blue square" apart from "blue circle and red square", which the plain pools mix up.
    -> MLP(hidden) -> embed_dim.
    """

    def __init__(
        self,
        width: int = 24,
        hidden: int = 128,
        embed_dim: int = 64,
        color_factors: int = 10,
        shape_factors: int = 8,
    ):
        super().__init__()
        self.config = {
            "width": width,
            "hidden": hidden,
            "embed_dim": embed_dim,
            "color_factors": color_factors,
            "shape_factors": shape_factors,
        }
        channels = [(3, width), (width, width), (width, 2 * width), (2 * width, 2 * width)]
        self.convs = nn.ModuleList(nn.Conv2d(c + 2, out, 3, padding=1) for c, out in channels)
        self.pool_after = (1, 2)  # conv indices followed by a 2x2 max pool
        self.color_map = nn.Conv2d(2 * width, color_factors, 1)
        self.shape_map = nn.Conv2d(2 * width, shape_factors, 1)
        self.head = nn.Sequential(
            nn.Linear(4 * width + color_factors * shape_factors, hidden),
            nn.GELU(),
            nn.Linear(hidden, embed_dim),
        )

    def forward(self, images: Tensor) -> Tensor:
        x = images.float() * 2 - 1
        for i, conv in enumerate(self.convs):
            x = nn.functional.gelu(conv(_with_coordinates(x)))
            if i in self.pool_after:
                x = nn.functional.max_pool2d(x, 2)
        color = torch.softmax(self.color_map(x), dim=1)  # (B, Fc, h, w)
        shape = nn.functional.gelu(self.shape_map(x))  # (B, Fs, h, w)
        bilinear = (color[:, :, None] * shape[:, None]).amax(dim=(3, 4))  # (B, Fc, Fs)
        pooled = torch.cat([x.amax(dim=(2, 3)), x.mean(dim=(2, 3)), bilinear.flatten(1)], dim=1)
        return self.head(pooled)  # (B, embed_dim)


class ShapesCLIP(nn.Module):
    """CLIP-style text-image scorer for ShapesWorld images (B, 3, H, W) in [0, 1]."""

    def __init__(
        self,
        text_model,
        tokenizer,
        image_encoder: ImageEncoder,
        logit_scale: float = INIT_LOGIT_SCALE,
    ):
        super().__init__()
        self.text_model = text_model
        self.tokenizer = tokenizer
        self.image_encoder = image_encoder
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale)))

    def encode_images(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> (B, D) unit-norm fp32 embeddings."""
        device = self.logit_scale.device
        return nn.functional.normalize(self.image_encoder(images.to(device)), dim=-1)

    def encode_texts(self, prompts: Sequence[str]) -> Tensor:
        """B prompts -> (B, D) unit-norm fp32 embeddings."""
        tokens = self.tokenizer(list(prompts), padding=True, return_tensors="pt")
        device = self.logit_scale.device
        output = self.text_model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
        )
        return nn.functional.normalize(output.text_embeds, dim=-1)

    @property
    def scale(self) -> Tensor:
        """exp(logit_scale), clamped at 100 as in CLIP."""
        return self.logit_scale.exp().clamp(max=100.0)

    def score(self, images: Tensor, prompts: Sequence[str], chunk: int = 512) -> Tensor:
        """Scaled cosine similarity of each image with its prompt: (B,) fp32.

        images: (B, 3, H, W) in [0, 1]; prompts: B strings. Computed in chunks of `chunk`.
        """
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        scores = []
        for start in range(0, len(prompts), chunk):
            img = self.encode_images(images[start : start + chunk])
            txt = self.encode_texts(prompts[start : start + chunk])
            scores.append(self.scale * (img * txt).sum(dim=-1))
        return torch.cat(scores).float()

    def save(self, path: str | Path) -> None:
        """Write the model directory (see the module docstring)."""
        from safetensors.torch import save_file

        path = Path(path)
        self.text_model.save_pretrained(path / "text")
        self.tokenizer.save_pretrained(path / "text")
        state = {f"image_encoder.{k}": v for k, v in self.image_encoder.state_dict().items()}
        save_file({**state, "logit_scale": self.logit_scale.detach()}, path / "image.safetensors")
        (path / "shapesclip.json").write_text(
            json.dumps({"image_encoder": self.image_encoder.config})
        )


def load_shapesclip(path: str | Path, device: str = "cpu") -> ShapesCLIP:
    """Load a ShapesCLIP directory written by `train_shapesclip` / `ShapesCLIP.save`, in eval
    mode."""
    from safetensors.torch import load_file
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

    path = Path(path)
    config = json.loads((path / "shapesclip.json").read_text())
    model = ShapesCLIP(
        CLIPTextModelWithProjection.from_pretrained(path / "text"),
        PreTrainedTokenizerFast.from_pretrained(path / "text"),
        ImageEncoder(**config["image_encoder"]),
    )
    state = load_file(path / "image.safetensors")
    model.logit_scale.data.copy_(state.pop("logit_scale"))
    model.image_encoder.load_state_dict(
        {k.removeprefix("image_encoder."): v for k, v in state.items()}
    )
    return model.to(device).eval()


# ----------------------------------------------------------------------------- training


def _scene_detections(objects: Sequence[Mapping], meta: Mapping) -> dict[str, list[Detection]]:
    """Perfect detections of a laid-out scene, for judging it against `meta`. Objects whose
    color `meta` names for their class come first, so GenEval's top-`count` pick sees them
    (a scene with a red and a blue circle does contain "a red circle")."""
    wanted = {(c["class"], c.get("color")) for c in meta["include"]}
    found: dict[str, list[Detection]] = {}
    for obj in sorted(objects, key=lambda o: (o["class"], o["color"]) not in wanted):
        found.setdefault(obj["class"], []).append(Detection(obj["box"], 1.0, obj["color"]))
    return found


# Per tag, the corruptions that test what the tag is about (binding, relation, count); a
# caption's first hard negative is one of these, the others are of any kind.
FOCUS_KINDS = {
    "single_object": ("wrong_class",),
    "two_object": ("wrong_class",),
    "counting": ("missing_object", "extra_object"),
    "colors": ("wrong_color", "wrong_class"),
    "position": ("swapped_relation",),
    "color_attr": ("swapped_colors",),
}


# Per tag, the corruption whose caption is a hard negative on the text side (NegCLIP): the
# same scene structure with the binding, relation or color changed.
TEXT_NEGATIVE_KINDS = {
    "colors": "wrong_color",
    "position": "swapped_relation",
    "color_attr": "swapped_colors",
}


def _negative_kinds(tag: str, n: int, rng: np.random.Generator) -> list[str]:
    """n corruption kinds for a caption of `tag`: one of FOCUS_KINDS[tag] first, then any."""
    focus, kinds = FOCUS_KINDS[tag], world.CORRUPTIONS[tag]
    return [focus[rng.integers(len(focus))]] + [
        kinds[rng.integers(len(kinds))] for _ in range(n - 1)
    ]


@dataclass
class Batch:
    """One training batch of fresh renders (B captions, K hard negatives each).

    metas: the B metadata lines; prompts: their B prompts; text_negatives: (caption index,
    wrong caption) for captions of a tag in TEXT_NEGATIVE_KINDS; positives (B, 3, H, W); negatives
    (B, K, 3, H, W); matches (B, B): 1 where render j satisfies prompt i; attributes:
    `scene_attributes` of the B + B*K renders (positives first, then negatives caption by
    caption).
    """

    metas: list[dict]
    prompts: list[str]
    text_negatives: list[tuple[int, str]]
    positives: Tensor
    negatives: Tensor
    matches: Tensor
    attributes: dict[str, Tensor]


def _attribute_arrays(n: int) -> dict[str, np.ndarray]:
    s, c = len(world.SHAPE_NAMES), len(world.COLORS)
    return {
        "pairs": np.zeros((n, s, c), dtype=np.float32),
        "pairs_mask": np.zeros((n, s, c), dtype=np.float32),
        "counts": np.full((n, s), -100, dtype=np.int64),  # -100: not said, ignored
        "relations": np.zeros((n, s, s, len(RELATIONS)), dtype=np.float32),
        "relations_mask": np.zeros((n, s, s, len(RELATIONS)), dtype=np.float32),
    }


def _as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
    n = len(arrays["counts"])
    return {k: torch.from_numpy(v.reshape(n, -1)) for k, v in arrays.items()}


def scene_attributes(scenes: Sequence[Sequence[Mapping]]) -> dict[str, Tensor]:
    """What each laid-out scene contains, as auxiliary targets (all known, masks all 1).

    With S = len(world.SHAPE_NAMES), C = len(world.COLORS), N scenes, returns
    - "pairs" (N, S * C): 1 where an object of that class and color is present;
    - "counts" (N, S) long: objects per class;
    - "relations" (N, S * S * 4): 1 where some object of class a stands in the relation
      (GenEval's rule, order of `RELATIONS`) to some object of class b != a;
    - "pairs_mask", "relations_mask": which entries are targets (1 here; diagonal class
      pairs of "relations" are always 0).
    """
    shapes, colors = world.SHAPE_NAMES, tuple(world.COLORS)
    out = _attribute_arrays(len(scenes))
    out["pairs_mask"][:] = 1.0
    out["counts"][:] = 0
    out["relations_mask"][:] = 1.0
    for n, objects in enumerate(scenes):
        for obj in objects:
            out["pairs"][n, shapes.index(obj["class"]), colors.index(obj["color"])] = 1.0
            out["counts"][n, shapes.index(obj["class"])] += 1
            for other in objects:
                if other["class"] != obj["class"]:
                    a, b = shapes.index(obj["class"]), shapes.index(other["class"])
                    for relation in relative_position(obj["box"], other["box"]):
                        out["relations"][n, a, b, RELATIONS.index(relation)] = 1.0
    return _as_tensors(out)


def caption_attributes(metas: Sequence[Mapping]) -> dict[str, Tensor]:
    """The attributes a caption states, in the layout of `scene_attributes`, masks marking
    what it says: the color of a colored object (its class row: 1 at the color, 0 elsewhere),
    the count of each named class, and for a position line the relation and its opposite
    (both class orders). Everything else (e.g. whether other classes are present) is masked.
    """
    shapes, colors = world.SHAPE_NAMES, tuple(world.COLORS)
    out = _attribute_arrays(len(metas))
    for n, meta in enumerate(metas):
        include = meta["include"]
        for clause in include:
            a = shapes.index(clause["class"])
            out["counts"][n, a] = clause["count"]
            if "color" in clause:
                out["pairs"][n, a, colors.index(clause["color"])] = 1.0
                out["pairs_mask"][n, a] = 1.0
            if "position" in clause:
                relation, target = clause["position"]
                b = shapes.index(include[target]["class"])
                opposite = world.OPPOSITE[relation]
                for x, y, yes, no in ((a, b, relation, opposite), (b, a, opposite, relation)):
                    out["relations"][n, x, y, RELATIONS.index(yes)] = 1.0
                    out["relations_mask"][n, x, y, RELATIONS.index(yes)] = 1.0
                    out["relations_mask"][n, x, y, RELATIONS.index(no)] = 1.0
    return _as_tensors(out)


def attribute_loss(logits: Tensor, targets: Mapping[str, Tensor]) -> Tensor:
    """Masked auxiliary loss of the shared attribute head: BCE on pairs and relations (mean
    over unmasked entries), CE on each stated class count (0..MAX_OBJECTS).

    logits: (N, `attribute_size()`), split as pairs | counts (S x (MAX_OBJECTS + 1)) |
    relations; targets: from `scene_attributes` or `caption_attributes`.
    """
    n_pairs, n_rel = targets["pairs"].shape[1], targets["relations"].shape[1]
    n_shapes = targets["counts"].shape[1]
    pair_logits, count_logits, rel_logits = logits.split(
        [n_pairs, n_shapes * (world.MAX_OBJECTS + 1), n_rel], dim=1
    )

    def masked_bce(x: Tensor, name: str) -> Tensor:
        mask = targets[f"{name}_mask"]
        bce = nn.functional.binary_cross_entropy_with_logits(x, targets[name], reduction="none")
        return (bce * mask).sum() / mask.sum().clamp_min(1.0)

    counts = targets["counts"].reshape(-1)
    count_ce = (
        nn.functional.cross_entropy(
            count_logits.reshape(-1, world.MAX_OBJECTS + 1), counts, ignore_index=-100
        )
        if (counts >= 0).any()
        else count_logits.sum() * 0.0
    )
    return masked_bce(pair_logits, "pairs") + count_ce + masked_bce(rel_logits, "relations")


class AttributeHead(nn.Module):
    """Cosine classifier over unit-norm embeddings: logits = scale * (w_k / |w_k|) . e + b_k.

    Row norms are fixed, so an attribute can only be read out if the embeddings of the two
    cases point apart (a plain linear head can blow up a tiny difference instead, and the
    embeddings stay collapsed for the contrastive loss)."""

    def __init__(self, embed_dim: int, scale: float = 10.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(attribute_size(), embed_dim) / embed_dim**0.5)
        self.bias = nn.Parameter(torch.zeros(attribute_size()))
        self.scale = scale

    def forward(self, embeddings: Tensor) -> Tensor:
        """(N, D) unit-norm -> (N, attribute_size()) logits."""
        return self.scale * embeddings @ nn.functional.normalize(self.weight, dim=1).T + self.bias


def attribute_size() -> int:
    """Width of the attribute head output (see `attribute_loss`)."""
    s, c = len(world.SHAPE_NAMES), len(world.COLORS)
    return s * c + s * (world.MAX_OBJECTS + 1) + s * s * len(RELATIONS)


def make_batch(
    rng: np.random.Generator,
    batch_size: int,
    negatives: int,
    *,
    pool: Sequence[Mapping] | None = None,
    image_size: int = 32,
) -> Batch:
    """Fresh renders of `batch_size` random captions and `negatives` hard negatives each."""
    metas = world.sample_metadata(rng, batch_size, pool=pool)
    scenes = [world.layout(m, rng, image_size) for m in metas]
    wrong = [
        world.layout(world.corrupt(meta, kind, rng), rng, image_size)
        for meta in metas
        for kind in _negative_kinds(meta["tag"], negatives, rng)
    ]
    matches = torch.tensor(
        [[evaluate(m, _scene_detections(s, m))[0] for s in scenes] for m in metas],
        dtype=torch.float32,
    )
    images = np.stack([world.draw(s, image_size) for s in scenes + wrong])  # (B + B*K, H, W, 3)
    images = torch.from_numpy(images).permute(0, 3, 1, 2)  # (B + B*K, 3, H, W)
    text_negatives = [
        (i, world.prompt_for(world.corrupt(m, TEXT_NEGATIVE_KINDS[m["tag"]], rng)))
        for i, m in enumerate(metas)
        if m["tag"] in TEXT_NEGATIVE_KINDS
    ]
    return Batch(
        metas=metas,
        prompts=[m["prompt"] for m in metas],
        text_negatives=text_negatives,
        positives=images[:batch_size],
        negatives=images[batch_size:].unflatten(0, (batch_size, negatives)),  # (B, K, 3, H, W)
        matches=matches,
        attributes=scene_attributes(scenes + wrong),
    )


def contrastive_loss(
    text: Tensor, positives: Tensor, negatives: Tensor, matches: Tensor, scale: Tensor
) -> tuple[Tensor, Tensor]:
    """Multi-positive InfoNCE both ways plus a hard-negative term (module docstring).

    text (B, D), positives (B, D), negatives (B, K, D): unit-norm embeddings; matches (B, B)
    in {0, 1} with a unit diagonal; scale: exp(logit_scale).
    Returns (loss, hard-negative accuracy: share of (caption, negative) pairs with the
    caption's own render scored higher).
    """
    logits_pos = scale * text @ positives.T  # (B, B) caption x render
    logits_neg = scale * torch.einsum("bd,bkd->bk", text, negatives)  # (B, K) own negatives
    t2i_logits = torch.cat([logits_pos, logits_neg], dim=1)  # (B, B + K)
    t2i_target = torch.cat([matches, torch.zeros_like(logits_neg)], dim=1)
    t2i_target = t2i_target / t2i_target.sum(dim=1, keepdim=True)
    i2t_target = matches.T / matches.T.sum(dim=1, keepdim=True)  # (B, B) render x caption
    t2i = torch.sum(-t2i_target * torch.log_softmax(t2i_logits, dim=1), dim=1).mean()
    i2t = torch.sum(-i2t_target * torch.log_softmax(logits_pos.T, dim=1), dim=1).mean()
    own = torch.cat([logits_pos.diagonal()[:, None], logits_neg], dim=1)  # (B, 1 + K)
    hard = -torch.log_softmax(own, dim=1)[:, 0].mean()  # own render against own negatives
    accuracy = (logits_pos.diagonal()[:, None] > logits_neg).float().mean()
    return 0.5 * (t2i + i2t) + hard, accuracy


def text_negative_loss(
    images: Tensor, text: Tensor, wrong_text: Tensor, rows: Tensor, scale: Tensor
) -> Tensor:
    """Hard negatives on the text side (NegCLIP, Yuksekgonul et al. 2023): for each render
    `rows[m]`, softmax over its own caption and the wrong caption m, target its own caption.

    images, text: (B, D) unit-norm; wrong_text: (M, D) unit-norm; rows: (M,) long.
    Returns the mean cross-entropy (0 if M = 0).
    """
    if len(rows) == 0:
        return scale * 0.0
    right = (images[rows] * text[rows]).sum(dim=1)  # (M,)
    wrong = (images[rows] * wrong_text).sum(dim=1)  # (M,)
    logits = scale * torch.stack([right, wrong], dim=1)  # (M, 2)
    return -torch.log_softmax(logits, dim=1)[:, 0].mean()


def train_shapesclip(
    out_dir: str | Path,
    *,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    image_size: int = 32,
    negatives: int = 2,
    warmup: int = 100,
    attribute_weight: float = 1.0,
    pool: Sequence[Mapping] | None = None,
    text_kwargs: Mapping | None = None,
    image_kwargs: Mapping | None = None,
    progress: bool = True,
) -> dict:
    """Train ShapesCLIP on fresh renders and save it (model + tokenizer) to `out_dir`.

    steps, batch_size (captions per step), lr (AdamW peak; linear warmup over `warmup` steps,
    cosine decay to 0), negatives (hard negatives K per caption), pool (metadata lines to
    draw captions from; default the whole world), text_kwargs (for `build_text_config`),
    image_kwargs (for `ImageEncoder`).
    Deterministic in `seed` on CPU. The directory is written under a temporary name and
    renamed at the end. Returns metrics: final loss and hard-negative accuracy (mean of the
    last 10% of steps), seconds, parameter count.
    """
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()
    text_config = build_text_config(tokenizer, **(text_kwargs or {}))
    image_encoder = ImageEncoder(
        **{"embed_dim": text_config.projection_dim, **(image_kwargs or {})}
    )
    clip = ShapesCLIP(CLIPTextModelWithProjection(text_config), tokenizer, image_encoder).train()
    attribute_head = AttributeHead(image_encoder.config["embed_dim"])
    parameters = [*clip.parameters(), *attribute_head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
        ),
    )
    history: list[tuple[float, float]] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        batch = make_batch(rng, batch_size, negatives, pool=pool, image_size=image_size)
        images = torch.cat([batch.positives, batch.negatives.flatten(0, 1)])  # (B + B*K, ...)
        embeddings = clip.encode_images(world.degrade(images, gen))  # (B + B*K, D)
        text = clip.encode_texts(batch.prompts)
        loss, accuracy = contrastive_loss(
            text,
            embeddings[:batch_size],
            embeddings[batch_size:].unflatten(0, (batch_size, negatives)),  # (B, K, D)
            batch.matches,
            clip.scale,
        )
        if batch.text_negatives:
            rows, wrong_prompts = zip(*batch.text_negatives, strict=True)
            loss = loss + text_negative_loss(
                embeddings[:batch_size],
                text,
                clip.encode_texts(wrong_prompts),
                torch.tensor(rows),
                clip.scale,
            )
        # one attribute head reads both towers, pulling them into one decodable space
        aux = attribute_loss(attribute_head(embeddings), batch.attributes)
        aux = aux + attribute_loss(attribute_head(text), caption_attributes(batch.metas))
        loss = loss + attribute_weight * aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append((loss.item(), accuracy.item()))
        if progress and (step % 100 == 0 or step == steps - 1):
            print(
                f"shapesclip step {step:5d}  loss {loss.item():.4f}  hard-neg acc "
                f"{accuracy.item():.3f}  scale {clip.scale.item():.1f}  "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
    tail = np.array(history[-max(steps // 10, 1) :])
    metrics = {
        "loss": float(tail[:, 0].mean()),
        "hard_negative_accuracy": float(tail[:, 1].mean()),
        "scale": float(clip.scale.item()),
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),  # all threads
        "parameters": sum(p.numel() for p in clip.parameters()),
        "steps": steps,
        "batch_size": batch_size,
        "negatives": negatives,
    }
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    clip.eval().save(tmp)
    (tmp / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return metrics

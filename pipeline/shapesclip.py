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
  (which object kinds are present) and mean (how many), and sees two coordinate channels
  (CoordConv, Liu et al. 2018) so that positions survive the pooling.
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
Loss = mean of the first two cross-entropies + the third. The first negative of a caption is
of a kind that tests binding (see `_negative_kinds`). Images are degraded (`world.degrade`: blur, noise,
color offsets) so that generated images are scored too.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from pipeline import world
from pipeline.geneval import Detection, evaluate

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
        words += [shape, shape + "s"]
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


class ImageEncoder(nn.Module):
    """Conv encoder: (B, 3, H, W) in [0, 1] -> (B, embed_dim) (unnormalized).

    [image * 2 - 1, x, y] (5 channels, coordinates in [-1, 1]) -> conv3x3(width) -> conv3x3
    -> maxpool 2 -> conv3x3(2 width) -> maxpool 2 -> conv3x3 -> [max, mean] over space
    (4 width) -> MLP(hidden) -> embed_dim. GELU after every conv and hidden layer.
    """

    def __init__(self, width: int = 32, hidden: int = 128, embed_dim: int = 64):
        super().__init__()
        self.config = {"width": width, "hidden": hidden, "embed_dim": embed_dim}
        self.convs = nn.Sequential(
            nn.Conv2d(5, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.GELU(),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Linear(4 * width, hidden), nn.GELU(), nn.Linear(hidden, embed_dim)
        )

    def forward(self, images: Tensor) -> Tensor:
        b, _, h, w = images.shape
        ys, xs = torch.meshgrid(
            torch.linspace(-1, 1, h, device=images.device),
            torch.linspace(-1, 1, w, device=images.device),
            indexing="ij",
        )
        coords = torch.stack([xs, ys]).expand(b, 2, h, w)  # (B, 2, H, W)
        features = self.convs(torch.cat([images.float() * 2 - 1, coords], dim=1))  # (B, C, h, w)
        pooled = torch.cat([features.amax(dim=(2, 3)), features.mean(dim=(2, 3))], dim=1)
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


def _negative_kinds(tag: str, n: int, rng: np.random.Generator) -> list[str]:
    """n corruption kinds for a caption of `tag`: the first one of the kinds that test binding
    (all but an object simply left out, which is easy except for counting), the rest of any."""
    kinds = world.CORRUPTIONS[tag]
    binding = [k for k in kinds if k != "missing_object" or tag == "counting"]
    return [binding[rng.integers(len(binding))]] + [
        kinds[rng.integers(len(kinds))] for _ in range(n - 1)
    ]


def make_batch(
    rng: np.random.Generator,
    batch_size: int,
    negatives: int,
    *,
    pool: Sequence[Mapping] | None = None,
    image_size: int = 32,
) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """One training batch of fresh renders.

    Returns (prompts (B,), positives (B, 3, H, W), hard negatives (B, K, 3, H, W),
    matches (B, B) float: matches[i, j] = 1 if render j satisfies prompt i).
    """
    metas = world.sample_metadata(rng, batch_size, pool=pool)
    scenes = [world.layout(m, rng, image_size) for m in metas]
    positives = [world.draw(s, image_size) for s in scenes]
    hard = []
    for meta in metas:
        for kind in _negative_kinds(meta["tag"], negatives, rng):
            hard.append(world.render(world.corrupt(meta, kind, rng), rng, image_size))
    matches = torch.tensor(
        [[evaluate(m, _scene_detections(s, m))[0] for s in scenes] for m in metas],
        dtype=torch.float32,
    )
    to_tensor = lambda arrays: torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # noqa: E731
    neg = to_tensor(hard).reshape(batch_size, negatives, 3, image_size, image_size)
    return [m["prompt"] for m in metas], to_tensor(positives), neg, matches


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


def train_shapesclip(
    out_dir: str | Path,
    *,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    image_size: int = 32,
    negatives: int = 2,
    warmup: int = 100,
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
    optimizer = torch.optim.AdamW(clip.parameters(), lr=lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
        ),
    )
    history: list[tuple[float, float]] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        prompts, pos, neg, matches = make_batch(
            rng, batch_size, negatives, pool=pool, image_size=image_size
        )
        images = world.degrade(torch.cat([pos, neg.flatten(0, 1)]), gen)  # (B + B*K, 3, H, W)
        embeddings = clip.encode_images(images)
        text = clip.encode_texts(prompts)
        loss, accuracy = contrastive_loss(
            text,
            embeddings[:batch_size],
            embeddings[batch_size:].unflatten(0, (batch_size, negatives)),  # (B, K, D)
            matches,
            clip.scale,
        )
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

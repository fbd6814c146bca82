"""Session 16 scratch check (issue 18): ShapesCLIP whose image encoder also pools where each shape
factor is (a spatial soft-argmax, Levine et al. 2016: the softmax over locations of the factor's
logit map, its expected (x, y) in [-1, 1], 2 x shape_factors more pooled features), trained with
the committed recipe and a seed, then the world check's hard-negative gate. One torch thread:

    OMP_NUM_THREADS=1 python reports/world/shapesclip-seeds/position-pool/clip_position.py SEED

writes /tmp/s16/clippos-s<SEED>-n1500 (the model) and /tmp/s16/wcpos-s<SEED>-n1500 (the check).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "longer"))
import torch  # noqa: E402
from clip_longer import train_and_check  # noqa: E402
from torch import nn  # noqa: E402

from pipeline import shapesclip  # noqa: E402


class PositionEncoder(shapesclip.ImageEncoder):
    """The committed ImageEncoder plus each shape factor's soft-argmax position."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        c = self.config
        pooled = 4 * c["width"] + c["color_factors"] * c["shape_factors"] + 2 * c["shape_factors"]
        self.head = nn.Sequential(
            nn.Linear(pooled, c["hidden"]), nn.GELU(), nn.Linear(c["hidden"], c["embed_dim"])
        )

    def forward(self, images):
        x = images.float() * 2 - 1
        for i, conv in enumerate(self.convs):
            x = nn.functional.gelu(conv(shapesclip._with_coordinates(x)))
            if i in self.pool_after:
                x = nn.functional.max_pool2d(x, 2)
        color = torch.softmax(self.color_map(x), dim=1)
        logits = self.shape_map(x)  # (B, Fs, h, w)
        shape = nn.functional.gelu(logits)
        bilinear = (color[:, :, None] * shape[:, None]).amax(dim=(3, 4))
        _, _, h, w = logits.shape
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
        attention = torch.softmax(logits.flatten(2), dim=-1)  # (B, Fs, h * w)
        where = attention @ torch.stack([xs.flatten(), ys.flatten()], dim=1)  # (B, Fs, 2)
        pooled = [x.amax(dim=(2, 3)), x.mean(dim=(2, 3)), bilinear.flatten(1), where.flatten(1)]
        return self.head(torch.cat(pooled, dim=1))


def main(seed: int, steps: int = 1500) -> None:
    shapesclip.ImageEncoder = PositionEncoder  # training and load_shapesclip both build it
    train_and_check(
        seed, steps, f"/tmp/s16/clippos-s{seed}-n{steps}", f"/tmp/s16/wcpos-s{seed}-n{steps}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""Session 41 scratch measurement: the default base's UNet (`data/base/model`) in fp32 against
bf16 autocast on this CPU, at a rollout's forward batch (192) and an update's forward+backward
(64), median of 5 interleaved calls, random inputs of the model's shapes.

    python reports/search/make-run/bf16_forward.py [THREADS]
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

REPO = Path(__file__).resolve().parents[3]


def inputs(batch: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, 4, 16, 16, generator=gen),  # latents
        torch.rand(batch, generator=gen) * 1000,  # timesteps
        torch.randn(batch, 12, 64, generator=gen),  # token states
        torch.randn(batch, 64, generator=gen),  # pooled text vector
    )


def call(model, args: tuple[torch.Tensor, ...], bf16: bool, backward: bool) -> torch.Tensor:
    latents, timesteps, tokens, pooled = args
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
        torch.set_grad_enabled(backward),
    ):
        out = model(latents, timesteps, encoder_hidden_states=tokens, class_labels=pooled).sample
    if backward:
        out.float().square().mean().backward()
    return out


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    model = UNet2DConditionModel.from_pretrained(REPO / "data/base/model/transformer").eval()
    for name, batch, backward in [
        ("forward, batch 192", 192, False),
        ("fwd+bwd, batch 64", 64, True),
    ]:
        args = inputs(batch)  # drawn once, outside the timed calls
        seconds = {False: [], True: []}
        for repeat in range(6):
            for bf16 in (False, True):
                start = time.perf_counter()
                call(model, args, bf16, backward)
                if repeat:  # the first call of each is a warm-up
                    seconds[bf16].append(time.perf_counter() - start)
        fp32, bf16 = (statistics.median(seconds[k]) for k in (False, True))
        print(
            f"{name}: fp32 {fp32 * 1e3:.1f} ms, bf16 {bf16 * 1e3:.1f} ms, ratio {fp32 / bf16:.2f}"
        )
    args = inputs(64)
    full, half = call(model, args, False, False), call(model, args, True, False).float()
    print(f"relative difference of the outputs: {((full - half).norm() / full.norm()).item():.4f}")


if __name__ == "__main__":
    main()

"""Session 34 scratch measurement (reports/search.md, session 34 §3): how far apart the base's
text encoder puts prompts that differ only in the relation's direction, its axis, or the
objects' order. The denoiser sees a prompt only through these encodings (token states for
cross-attention, the pooled vector in the timestep embedding), so two prompts it encodes alike
it cannot draw apart.

    python reports/search/relation/prompt_encodings.py OUT.json

For each training position line "X <relation> Y" and each variant (the opposite direction on
the same axis, the other axis, the objects swapped): the relative L2 distance of the token
states ||h - h'|| / ||h|| and the cosine of the pooled vectors, mean over lines; and the cosine
of the relation words' own token embeddings.
"""

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.policy import load_backend  # noqa: E402

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
OTHER_AXIS = {"left of": "above", "right of": "below", "above": "left of", "below": "right of"}
PATTERN = re.compile(r"^(.*\ban? )(\w+) (left of|right of|above|below) (an? )(\w+)$")


def variants(prompt: str) -> dict[str, str]:
    """The prompt with the opposite direction, the other axis, and the two objects swapped."""
    head, x, relation, article, y = PATTERN.match(prompt).groups()
    return {
        "opposite direction": f"{head}{x} {OPPOSITE[relation]} {article}{y}",
        "other axis": f"{head}{x} {OTHER_AXIS[relation]} {article}{y}",
        "objects swapped": f"{head}{y} {relation} {article}{x}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    cfg = load_config(REPO / "params.yaml")
    backend = load_backend(cfg)
    lines = [m["prompt"] for m in layout.load_prompts(cfg, "train") if m["tag"] == "position"]
    base = backend.encode_prompts(lines)
    out: dict = {"lines": len(lines), "variants": {}}
    for name in ("opposite direction", "other axis", "objects swapped"):
        other = backend.encode_prompts([variants(p)[name] for p in lines])
        distance = (base.hidden - other.hidden).flatten(1).norm(dim=1) / base.hidden.flatten(
            1
        ).norm(dim=1)
        cosine = torch.nn.functional.cosine_similarity(base.pooled, other.pooled, dim=1)
        out["variants"][name] = {
            "token_states_relative_distance": float(distance.mean()),
            "pooled_cosine": float(cosine.mean()),
        }
    table = backend.text_encoder.get_input_embeddings().weight
    word = {
        w: table[backend.tokenizer.convert_tokens_to_ids(w)]
        for w in ("left", "right", "above", "below")
    }
    pairs = [("left", "right"), ("above", "below"), ("left", "above"), ("right", "below")]
    out["word_embedding_cosine"] = {
        f"{a}/{b}": float(torch.nn.functional.cosine_similarity(word[a], word[b], dim=0))
        for a, b in pairs
    }
    write_json(args.out, out)
    print(out)


if __name__ == "__main__":
    with torch.no_grad():
        main()

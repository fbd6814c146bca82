"""Typed, validated configuration: one pydantic model per `params.yaml` section.

`params.yaml` is the single source of every knob. `load_config` reads it, applies `-S key=value`
overrides (the same syntax as `dvc exp run -S`), and validates everything up front, so a typo
fails before any work starts with one readable line (see `ConfigError`). Paths in the file are
relative to the directory that holds it, never to the current directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

Method = Literal["flow_grpo", "stepwise", "tp_grpo"]
SamplerKind = Literal["ode", "flow_grpo", "cps", "stepwise"]
Tag = Literal["single_object", "two_object", "counting", "colors", "position", "color_attr"]
TagWeights = dict[Tag, Annotated[float, Field(ge=0)]]  # tag -> weight, drawn in proportion
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
Probability = Annotated[float, Field(ge=0, le=1)]

#: The SDE each method samples with when `rollout.sampler` is `auto`.
METHOD_SAMPLER: dict[str, str] = {
    "flow_grpo": "flow_grpo",
    "stepwise": "stepwise",
    "tp_grpo": "flow_grpo",
}


class CreditflowError(Exception):
    """An error the user can act on: the CLI prints its one-line message, no traceback."""

    exit_code = 1


class ConfigError(CreditflowError, ValueError):
    """A bad parameter or input path: one line, `<dotted.key>: <what was expected>`."""

    exit_code = 2


class Section(BaseModel):
    # inf and NaN are never a sensible knob (`update.lr=.inf` would train NaN weights)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class WorldParams(Section):
    """ShapesWorld: what scenes look like."""

    image_size: PositiveInt = 32  # pixels per side
    shapes: list[str] = ["circle", "square", "triangle", "cross", "star", "diamond"]
    colors: list[str] = [
        "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
    ]  # fmt: skip
    max_count: Annotated[int, Field(ge=1, le=4)] = 4  # largest count in counting prompts

    @field_validator("shapes")
    @classmethod
    def _known_shapes(cls, shapes: list[str]) -> list[str]:
        from pipeline.world import SHAPE_NAMES

        unknown = [s for s in shapes if s not in SHAPE_NAMES]
        if unknown or len(set(shapes)) != len(shapes) or len(shapes) < 2:
            raise ValueError(
                f"expected two or more distinct shapes of {', '.join(SHAPE_NAMES)}, got {shapes}"
            )
        return shapes


def _with_positive_sum(weights: TagWeights) -> TagWeights:
    if sum(weights.values()) <= 0:
        raise ValueError("the tag weights must have a positive sum")
    return weights


def _flow_grpo_mix() -> dict[str, float]:
    from pipeline.world import FLOW_GRPO_MIX

    return dict(FLOW_GRPO_MIX)


def _late_two_class_curriculum() -> dict[str, float]:
    return {"single_object": 1.0, "two_object": 3.0, "counting": 1.0, "colors": 1.0,
            "position": 6.0, "color_attr": 3.0}  # fmt: skip


class PromptsParams(Section):
    """`prompts` stage: GenEval-format train/test prompt sets."""

    n_train: PositiveInt = 600
    n_test: PositiveInt = 144  # spread evenly over the six tags
    seed: int = 0
    # training lines per tag, in proportion (Flow-GRPO's GenEval mix by default)
    mix: TagWeights = Field(default_factory=_flow_grpo_mix)

    @field_validator("mix")
    @classmethod
    def _mix_has_weight(cls, mix: TagWeights) -> TagWeights:
        return _with_positive_sum(mix)


class ModelParams(Section):
    """Which policy backend the loop trains."""

    backend: Literal["shapes", "sd3"] = "shapes"
    path: Path = Path("data/base/model")  # shapes: written by `base`; sd3: local diffusers dir
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights; SDE math is always fp32
    device: str = "cpu"
    resolution: PositiveInt = 512  # sd3: image side in pixels (Flow-GRPO trains SD3.5-M at 512)
    max_sequence_length: PositiveInt = 256  # sd3: T5 prompt tokens (the SD3 pipeline's default)


class BaseParams(Section):
    """`base` stage: pretrain the embedded flow model (and ShapesCLIP) on ShapesWorld renders."""

    pool: Literal["world", "train"] = "world"  # scenes to pretrain on (see stages/base.py)
    steps: PositiveInt = 3000  # flow-matching optimizer steps
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 1e-3
    warmup: Annotated[int, Field(ge=0)] = 200  # linear lr warmup steps
    lr_decay: Literal["cosine", "constant"] = "cosine"  # after warmup
    weight_decay: Annotated[float, Field(ge=0)] = 0.0  # AdamW
    grad_clip: PositiveFloat = 1.0  # max global gradient norm
    ema_decay: Probability = 0.999
    caption_dropout: Probability = 0.1  # share of empty captions, for classifier-free guidance
    # logit-normal timestep sampling (SD3): mean and std of the logit; ln 3 matches shift 3
    t_mean: float = 1.0986
    t_std: PositiveFloat = 0.8  # 1.0 lost squares mid-schedule (reports/base/t_std/)
    seed: int = 0
    latent_channels: Annotated[int, Field(ge=0)] = 4  # autoencoder latent channels; 0 = pixels
    ae_channels: list[PositiveInt] = [16, 32]  # autoencoder widths per resolution level
    ae_steps: Annotated[int, Field(ge=0)] = 1500
    ae_lr: PositiveFloat = 2e-3
    ae_batch_size: PositiveInt = 32
    ae_object_weight: PositiveFloat = 4.0  # object pixels' weight in the reconstruction loss
    ae_kl_weight: Annotated[float, Field(ge=0)] = 1e-6
    # the denoiser: SD3's MMDiT (patch_size, num_layers, num_heads, head_dim) or an SD-style
    # UNet (unet_channels; convolutions, cross-attention at the coarsest level)
    denoiser: Literal["mmdit", "unet"] = "unet"
    patch_size: PositiveInt = 2  # transformer patch side, in latent pixels
    num_layers: PositiveInt = 4  # MMDiT blocks
    num_heads: PositiveInt = 4
    head_dim: PositiveInt = 32
    unet_channels: list[PositiveInt] = [32, 64]  # UNet widths per resolution level (x16)
    text_dim: PositiveInt = 64  # tiny CLIP text encoder width (trained jointly)
    text_layers: PositiveInt = 2
    text_heads: PositiveInt = 2
    max_length: PositiveInt = 12  # prompt tokens including [BOS]/[EOS]
    # stage `refine`: a second flow cycle from the first one's weights (a warm restart). A base
    # trained twice as long composes two classes, and GRPO learns on it (reports/search.md,
    # sessions 30-32); 0: the first cycle is the base model
    refine_steps: Annotated[int, Field(ge=0)] = 3000
    refine_lr: PositiveFloat = 5e-4
    refine_warmup: Annotated[int, Field(ge=0)] = 100
    # the refine cycle's batches: each tag drawn in proportion to its weight (a tag left out:
    # never); empty: tag-balanced like the first cycle. The default, a late curriculum toward
    # two-class scenes, makes the base place the pair as stated
    # (reports/base/composition/README.md)
    refine_tag_weights: TagWeights = Field(default_factory=_late_two_class_curriculum)

    @field_validator("refine_tag_weights")
    @classmethod
    def _weights_have_a_positive_sum(cls, weights: TagWeights) -> TagWeights:
        return weights and _with_positive_sum(weights)


class ShapesCLIPParams(Section):
    """`shapesclip` stage: the contrastive text-image reward model of ShapesWorld."""

    # 1500 steps learned the swapped-relation negatives on two of four seeds, 3000 on all four
    # (reports/world/shapesclip-seeds/README.md)
    steps: PositiveInt = 3000
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 2e-3
    seed: int = 0


class SamplingParams(Section):
    """The denoising schedule shared by rollouts, scoring and evaluation."""

    num_steps: PositiveInt = 10  # training-time denoising steps T
    shift: PositiveFloat = 3.0  # FlowMatchEulerDiscreteScheduler shift
    guidance: Annotated[float, Field(ge=1)] = 4.5  # classifier-free guidance scale (1 = off)
    eval_num_steps: PositiveInt = 20


class RolloutParams(Section):
    """`rollout` stage: G trajectories per prompt with the method's SDE."""

    prompts_per_round: PositiveInt = 24
    group_size: Annotated[int, Field(ge=2)] = 8  # G, trajectories per prompt group
    sampler: Literal["auto", "flow_grpo", "cps", "stepwise"] = "auto"  # auto: the method's own SDE
    # Noise level per SDE: a of Flow-GRPO's SDE and of CPS, eta of the DDIM-style SDE (<= 1).
    eta: dict[Literal["flow_grpo", "cps", "stepwise"], Annotated[float, Field(ge=0)]] = {
        "flow_grpo": 0.7,
        "cps": 0.8,
        "stepwise": 1.0,
    }
    window_start: Annotated[int, Field(ge=0)] = 0  # first stochastic step
    window_end: int = 3  # one past the last stochastic step; -1 = all but the final step
    shared_noise: bool = True  # all samples of a group start from the same x_T
    # Train on the first n test lines of each tag instead of the training split (0 = off): the
    # held-out-free setting where the credit rules separate (4: the 24-line pool of
    # reports/search.md, sessions 42-50); the report then reads each claim on those lines too.
    train_on_test: Annotated[int, Field(ge=0)] = 0

    @field_validator("eta")
    @classmethod
    def _eta_in_range(cls, eta: dict[str, float]) -> dict[str, float]:
        for kind in ("cps", "stepwise"):  # their std is a share of sigma_next
            if eta.get(kind, 0.0) > 1:
                raise ValueError(f"eta.{kind} must be in [0, 1], got {eta[kind]}")
        return eta


class ScoreParams(Section):
    """`score` stage: rewards of clean-image estimates of cached states."""

    rewards: dict[str, Annotated[float, Field(ge=0)]] = {"geneval": 1.0}  # name -> weight
    # stepwise's clean estimate; tp_grpo's is always ode_completion (reports/estimators.md)
    estimator: Literal["tweedie", "ode_substeps", "ode_completion"] = "ode_completion"
    ode_substeps: PositiveInt = 5  # T' of the ode_substeps estimator (1 = Tweedie)
    # Euler steps of an ODE completion over the remaining schedule, evenly spaced; 0 = all of
    # them (the exact completion of TP-GRPO's paper)
    completion_steps: Annotated[int, Field(ge=0)] = 3
    batch_size: PositiveInt = 64  # states per model call when completing estimates
    estimate_images: Annotated[int, Field(ge=0)] = 4  # most non-monotonic trajectories kept
    # Real-image reward models (local directories, never downloaded; see pipeline.real_rewards).
    clip_path: Path = Path("data/rewards/clip")  # clipscore: CLIPModel + processor (e.g. PickScore)
    detector_path: Path = Path("data/rewards/owlv2")  # geneval_real*: OWLv2 detector + processor
    color_clip_path: Path = Path("data/rewards/clip")  # geneval_real*: CLIP for colour zero-shot
    reward_batch_size: PositiveInt = 16  # images per real-image reward model call
    reward_workers: PositiveInt = 1  # processes for ShapesWorld's detector (1: in-process)
    detector_nms_iou: Annotated[float, Field(gt=0, le=1)] = 1.0  # same-class IoU cap; 1 = off

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        return check_reward_mix(rewards)


class AdvantagesParams(Section):
    """`advantages` stage: per-method credit assignment."""

    clip: PositiveFloat = 5.0
    global_std: bool = False  # flow_grpo: std of the whole round instead of the group
    normalization: Literal["joint", "per_step"] = "joint"  # stepwise
    # stepwise: the last n trained steps take the final reward's advantage instead of their gain
    # (0 = the paper's rule)
    final_reward_steps: Annotated[int, Field(ge=0)] = 0
    tp_consistency: bool = True  # tp_grpo: sign(d_k) must agree with sign(R_sde - R_k)
    tp_first_step: bool = True  # tp_grpo: the k = 1 turning-point rule
    tp_balance: bool = True  # tp_grpo: balance turning points by the sign of their trend


class UpdateParams(Section):
    """`update` stage: PPO-clip GRPO on LoRA weights."""

    lr: PositiveFloat = 1e-3
    # over the run: constant, or cosine to lr / 10 by the run's progress (NFEs spent over
    # train.nfe_budget, or rounds over train.rounds without a budget)
    lr_decay: Literal["constant", "cosine"] = "constant"
    lora_rank: PositiveInt = 8
    lora_alpha: PositiveFloat = 16.0
    clip_range: PositiveFloat = 1e-3  # PPO ratio clip; log-probs are means over elements
    kl_beta: Annotated[float, Field(ge=0)] = 0.0
    inner_epochs: PositiveInt = 1
    minibatch_size: PositiveInt = 576  # (trajectory, step) pairs per optimizer step
    # pairs per forward/backward on one process, gradients accumulated (0 = a rank's whole
    # share of the minibatch): memory, not the algorithm
    micro_batch_size: Annotated[int, Field(ge=0)] = 0
    max_grad_norm: PositiveFloat = 1.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0


class TrainParams(Section):
    """`train` flow: rounds of rollout -> score -> advantages -> update."""

    method: Method = "flow_grpo"  # what a plain `creditflow train` runs
    methods: list[Method] = ["flow_grpo", "stepwise", "tp_grpo"]  # the DVC matrix
    seeds: list[int] = [0, 1, 2]  # the DVC matrix
    seed: int = 0
    rounds: PositiveInt = 40  # rounds per run (the cap when nfe_budget is set)
    # equal compute: stop a run before a round that would take its training NFEs over this
    # many (0 = off; pipeline.policy.round_fits_budget)
    nfe_budget: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 99840
    keep_rollouts: Annotated[int, Field(ge=0)] = 3  # newest rounds whose states stay; 0 = all
    # held-out probe: GenEval on the test prompts every `eval_every` rounds (0 = off), before
    # round 0 and after the last round too; `probe_images` fixed-seed images per test prompt
    eval_every: Annotated[int, Field(ge=0)] = 5
    probe_images: PositiveInt = 2


class EvaluateParams(Section):
    """`evaluate` stage: GenEval protocol on the test prompts."""

    images_per_prompt: PositiveInt = 8
    seed: int = 1234
    batch_size: PositiveInt = 64


class RescoreParams(Section):
    """`rescore` DVC stage: which training run's rollouts to re-score, with which reward mix."""

    run: str = "flow_grpo-s0"  # a run under data/train
    rewards: str = "shapes_clip=1"  # NAME[=WEIGHT],...


class BenchParams(Section):
    """`bench` stage: how many timings each median is taken over."""

    repeats: PositiveInt = 5  # timed rollouts (and bare network passes) per sampler
    round_repeats: PositiveInt = 3  # timed rounds per method, after one warm-up round each


class Config(Section):
    """All of `params.yaml`. `root` is the directory relative paths are resolved against."""

    root: Path = Path(".")
    params_file: Path | None = None  # the file this config was read from
    world: WorldParams = WorldParams()
    prompts: PromptsParams = PromptsParams()
    model: ModelParams = ModelParams()
    base: BaseParams = BaseParams()
    shapesclip: ShapesCLIPParams = ShapesCLIPParams()
    sampling: SamplingParams = SamplingParams()
    rollout: RolloutParams = RolloutParams()
    score: ScoreParams = ScoreParams()
    advantages: AdvantagesParams = AdvantagesParams()
    update: UpdateParams = UpdateParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    rescore: RescoreParams = RescoreParams()
    bench: BenchParams = BenchParams()

    @model_validator(mode="after")
    def _window_inside_schedule(self) -> Config:
        start, stop = self.rollout.window_start, self.sde_window_end
        if not 0 <= start < stop <= self.sampling.num_steps:
            raise ValueError(
                f"rollout.window_start..window_end selects steps [{start}, {stop}) of "
                f"{self.sampling.num_steps}: expected a non-empty range inside the schedule"
            )
        return self

    @property
    def sde_window_end(self) -> int:
        """`rollout.window_end` as an absolute step index (one past the last SDE step)."""
        end = self.rollout.window_end
        return end if end >= 0 else self.sampling.num_steps + end

    @property
    def sampler(self) -> str:
        """The SDE kind of the rollouts: `rollout.sampler`, or the method's own when `auto`."""
        chosen = self.rollout.sampler
        return METHOD_SAMPLER[self.train.method] if chosen == "auto" else chosen

    def path(self, relative: Path | str) -> Path:
        """Resolve a path from `params.yaml` against the file's directory."""
        p = Path(relative)
        return p if p.is_absolute() else self.root / p

    def flat(self) -> dict[str, Any]:
        """Dotted-key view of every parameter, for logging to MLflow."""
        return _flatten(self.model_dump(mode="json", exclude={"root", "params_file"}))


def check_reward_mix(rewards: dict[str, float]) -> dict[str, float]:
    """Reward names must be registered and some weight positive (else a ValueError)."""
    from pipeline.rewards import REWARDS

    if not rewards or sum(rewards.values()) <= 0:
        raise ValueError("needs at least one reward with a positive weight")
    for name in rewards:
        if name not in REWARDS:
            raise ValueError(f"{name!r} is not one of {', '.join(REWARDS)}")
    return rewards


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"train.method=tp_grpo"` -> (["train", "method"], "tp_grpo"); values parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text}: overrides look like key=value, e.g. train.method=tp_grpo")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted `key=value` in a copy of the raw params tree."""
    tree = yaml.safe_load(yaml.safe_dump(tree))  # deep copy of plain data
    for text in overrides:
        keys, value = parse_override(text)
        node = tree
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(keys[: depth + 1])}: is a value, not a section")
            node = child
        node[keys[-1]] = value
    return tree


def load_config(params: Path | str = "params.yaml", overrides: list[str] = ()) -> Config:
    """Read, override and validate `params.yaml`; raise `ConfigError` with one readable line."""
    params = Path(params).resolve()
    if not params.is_file():
        raise ConfigError(f"params: file not found: {params}")
    try:
        tree = yaml.load(params.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"params: {params.name}{_yaml_error(exc)}") from None
    if tree is None:
        raise ConfigError(f"params: {params.name} is empty (expected a mapping of sections)")
    if not isinstance(tree, dict):
        raise ConfigError(f"params: {params.name} must be a mapping of sections")
    tree = apply_overrides(tree, list(overrides))
    tree["root"] = str(params.parent)
    tree["params_file"] = str(params)
    return validate(tree)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last,
    silently dropping e.g. a whole duplicated section)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_error(exc: yaml.YAMLError) -> str:
    """' line L, column C: problem' (1-based) of a YAML error, or its class name."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or exc.__class__.__name__
    if mark is None:
        return f" is not valid YAML ({problem})"
    return f" line {mark.line + 1}, column {mark.column + 1}: {problem}"


def validate(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_first_error_line(exc)) from None


def _first_error_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"])
    value = err.get("input")
    kind = err["type"]
    if not key:  # a cross-section check: its message names the keys itself
        return err["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        choices = _literal_choices(err["ctx"]["expected"])
        return f"{key}: {value!r} is not one of {choices}"
    if kind == "extra_forbidden":
        return f"{key}: unknown key (check the spelling against params.yaml)"
    if kind == "value_error":
        return f"{key}: {err['msg'].removeprefix('Value error, ')}"
    return f"{key}: {err['msg'].lower()}, got {value!r}"


def _literal_choices(expected: str) -> str:
    # pydantic renders choices as "'a', 'b' or 'c'"; users read "a, b, c" faster.
    return expected.replace("'", "").replace(" or ", ", ")

"""The application: one Prefect task module per DVC stage, the flows that order them
(`flows.py`) and the `creditflow` command (`cli.py`).

Adding a stage: write `stages/<name>.py` with a task named `<name>` (its docstring's first
sentence is the command's help), add it to `STAGES` below with the params that shape it (to
`PER_ROUND` too if it works on one round of a run: `--run`/`--round`), and give it a `dvc.yaml`
entry whose deps and params `tests/test_dvc_deps.py` checks. A new params section
also goes into `pipeline/config.py` and `params.yaml`.
"""

# The params that shape a stage's outputs (a section, or one key): its `dvc.yaml` params
# (checked by tests/test_dvc_deps.py), and the only params its MLflow run logs.
_ROUND = ("model", "sampling", "rollout", "score", "advantages", "update")
_TRAIN = (
    *_ROUND,
    *("train.rounds", "train.nfe_budget", "train.keep_rollouts", "train.eval_every"),
    *("train.probe_images", "evaluate.seed", "evaluate.batch_size"),
)
# {stage: the params that shape it}, in pipeline order (`creditflow --help` lists them so). A
# per-round stage run on its own is a piece of `train`.
STAGES = {
    "prompts": ("world", "prompts"),
    "base": ("world", "model", "base"),
    "shapesclip": ("world", "model.backend", "shapesclip"),
    "refine": ("world", "model", "base"),
    "rollout": _TRAIN,
    "score": _TRAIN,
    "advantages": _TRAIN,
    "update": _TRAIN,
    "train": _TRAIN,
    "evaluate": ("model", "sampling", "evaluate"),
    "report": (
        *("train.methods", "train.seeds", "train.rounds", "train.nfe_budget"),
        *("rollout.prompts_per_round", "rollout.group_size", "rollout.train_on_test"),
        "sampling.num_steps",
        *("model.backend", "score.rewards"),
    ),
    "rescore": ("rescore", "score", "advantages", "sampling", "rollout", "model", "update"),
    "bench": (*_ROUND, "train.methods", "train.seeds", "bench"),
}
PER_ROUND = ("rollout", "score", "advantages", "update")

"""The application: one Prefect task module per DVC stage, the flows that order them
(`flows.py`) and the `creditflow` command (`cli.py`).

Adding a stage: write `stages/<name>.py` with a task named `<name>` (its docstring's first
sentence is the command's help), add its name to `STAGES` below (to `PER_ROUND` too if it works
on one round of a run: `--run`/`--round`), and give it a `dvc.yaml` entry whose deps
`tests/test_dvc_deps.py` checks. A new params section also goes into `pipeline/config.py` and
`params.yaml`.
"""

# In pipeline order; `creditflow --help` lists them so.
STAGES = (
    "prompts",
    "base",
    "refine",
    "rollout",
    "score",
    "advantages",
    "update",
    "train",
    "evaluate",
    "report",
    "rescore",
    "bench",
)
PER_ROUND = ("rollout", "score", "advantages", "update")

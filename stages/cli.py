"""`creditflow <stage>`: one subcommand per pipeline stage, all reading `params.yaml`.

Every command takes `--params FILE` and repeatable `-S key=value` overrides with the same syntax
as `dvc exp run -S`. A bad parameter prints one line `error: <key>: <expected>` and exits 2
before anything is written.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.config import Config, CreditflowError, load_config
from stages import PER_ROUND, STAGES

app = typer.Typer(
    name="creditflow",
    help="GRPO fine-tuning of flow-matching text-to-image models with step-wise credit assignment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ParamsFile = Annotated[
    Path, typer.Option("--params", help="params file; relative paths inside resolve against it")
]
Overrides = Annotated[
    list[str] | None,
    typer.Option("-S", "--set", help="override a parameter, e.g. -S train.rounds=5 (repeatable)"),
]
DEFAULT_PARAMS = Path("params.yaml")


def _config(params: Path, overrides: list[str] | None, *extra: str) -> Config:
    from pipeline.tracking import configure_environment

    cfg = load_config(params, [*(overrides or []), *extra])
    configure_environment(cfg.root)
    return cfg


def _run(name: str, params: Path, overrides: list[str] | None, *extra: str, **kwargs: Any) -> Any:
    from stages.flows import run_stage

    cfg = _config(params, overrides, *extra)
    return run_stage(name, cfg, **kwargs)


RunDir = Annotated[
    Path | None,
    typer.Option("--run", help="training run directory [default: data/train/<method>-s<seed>]"),
]
RoundIndex = Annotated[int, typer.Option("--round", help="round number")]


def train(
    params: ParamsFile = DEFAULT_PARAMS,
    set_: Overrides = None,
    method: Annotated[str | None, typer.Option(help="shortcut for -S train.method=...")] = None,
    seed: Annotated[int | None, typer.Option(help="shortcut for -S train.seed=...")] = None,
) -> None:
    """Train with GRPO: rounds of rollout -> score -> advantages -> update (resumable)."""
    extra = [f"train.method={method}"] if method is not None else []
    extra += [f"train.seed={seed}"] if seed is not None else []
    _run("train", params, set_, *extra)


def evaluate(
    params: ParamsFile = DEFAULT_PARAMS,
    set_: Overrides = None,
    policy: Annotated[
        str, typer.Option(help="'base' or a training run such as stepwise-s0")
    ] = "base",
) -> None:
    """GenEval protocol on the test prompts for the base model or a trained policy."""
    _run("evaluate", params, set_, policy=policy)


def rescore(
    rollouts: Annotated[Path, typer.Option(help="existing rollout dataset (left untouched)")],
    rewards: Annotated[str, typer.Option(help="reward mix, NAME[=WEIGHT],...")],
    out: Annotated[Path, typer.Option(help="directory for the new score table")],
    params: ParamsFile = DEFAULT_PARAMS,
    set_: Overrides = None,
) -> None:
    """Score existing rollouts with another reward mix and compare its credit with the old one."""
    _run("rescore", params, set_, rollouts=rollouts, rewards=rewards, out=out)


def runs(
    params: ParamsFile = DEFAULT_PARAMS,
    pipeline: Annotated[
        str | None,
        typer.Option(help="only this pipeline run (its `creditflow.pipeline` tag in MLflow)"),
    ] = None,
) -> None:
    """Held-out GenEval of every evaluated policy, per tag, from MLflow: a row per run and,
    per method with several seeds, the mean over seeds with its 95 % CI."""
    from rich.console import Console
    from rich.table import Table

    from pipeline.report import runs_table
    from pipeline.tracking import evaluation_runs, tracking_uri

    cfg = _config(params, None)
    evaluations = evaluation_runs(cfg.root, pipeline)
    if not evaluations:
        raise CreditflowError(
            f"no finished evaluation in {tracking_uri(cfg.root)}"
            " (run `creditflow evaluate --policy <run>` or `dvc repro` first)"
        )
    header, rows = runs_table(evaluations)
    table = Table(title="held-out GenEval (evaluation protocol, test prompts)")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def import_ablation(
    name: Annotated[
        str,
        typer.Option(
            help="kept as reports/ablations/<name> (per_step: read "
            "by the report's joint_vs_per_step claim)"
        ),
    ],
    source: Annotated[
        Path,
        typer.Option(
            "--from",
            help="the ablation's project directory: its params.yaml, reports/train, data/eval",
        ),
    ],
    method: Annotated[str, typer.Option(help="the method whose runs are kept")] = "stepwise",
    params: ParamsFile = DEFAULT_PARAMS,
) -> None:
    """Keep another experiment's evaluated runs of a method (a copy of this project run with an
    ablation's -S overrides) as an ablation of this one, for `creditflow report`."""
    from pipeline.ablation import import_ablation as keep

    folder = keep(_config(params, None), name, source, method)
    print(f"kept {method} runs of {source} in {folder} (params that differ: ablation.json)")


def with_server(
    command: Annotated[
        list[str], typer.Argument(help="the command and its arguments, e.g. dvc repro")
    ],
) -> None:
    """Run a command (`dvc repro`, `dvc exp run ...`) with one Prefect server for all of its
    stages, instead of a temporary server started by every stage process (~10 s each)."""
    from pipeline.tracking import configure_environment
    from stages.flows import shared_prefect_server

    if os.environ.get("PREFECT_API_URL"):  # a server is configured already
        raise typer.Exit(_wait_for(command, dict(os.environ)))
    configure_environment(Path.cwd())  # the project's PREFECT_HOME, as its stages will have
    with shared_prefect_server() as url:
        code = _wait_for(command, os.environ | {"PREFECT_API_URL": url})
    raise typer.Exit(code)


def _wait_for(command: list[str], env: dict[str, str]) -> int:
    """Run `command` to its end, through a Ctrl-C too (the terminal sends it to the command as
    well, which stops itself); its exit code as a shell reports it (128 + a killing signal)."""
    import signal
    import subprocess

    child = subprocess.Popen(command, env=env)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return code if code >= 0 else 128 - code


def stage_help(name: str) -> str:
    """The first sentence of `stages/<name>.py`'s docstring, read without importing it (the
    stage modules import torch and Prefect; `--help` and a typo should answer at once)."""
    doc = ast.get_docstring(ast.parse((Path(__file__).parent / f"{name}.py").read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split()).split(": ", 1)[-1]
    sentence = first.split(". ")[0].rstrip(".")
    return sentence[:1].upper() + sentence[1:] + "."


def plain_command(name: str):
    def command(params: ParamsFile = DEFAULT_PARAMS, set_: Overrides = None) -> None:
        _run(name, params, set_)

    return command


def round_command(name: str):
    def command(
        params: ParamsFile = DEFAULT_PARAMS,
        set_: Overrides = None,
        run: RunDir = None,
        round_: RoundIndex = 0,
    ) -> None:
        _run(name, params, set_, run=run, round_index=round_)

    return command


# Commands with options of their own are written out above; every other stage gets the plain
# (params, -S) or per-round (params, -S, --run, --round) command, in the pipeline's order.
SPECIAL = {"train": train, "evaluate": evaluate, "rescore": rescore}
for _name in STAGES:
    _make = round_command if _name in PER_ROUND else plain_command
    _command = SPECIAL.get(_name) or _make(_name)
    app.command(_name, help=_command.__doc__ or stage_help(_name))(_command)
app.command(  # a view of the tracking store, not a stage
    "runs", help="Held-out GenEval of every evaluated policy per tag, from MLflow, with CIs."
)(runs)
app.command("import-ablation", help=import_ablation.__doc__)(import_ablation)
app.command(  # runs other commands, not a stage
    "with-server",
    help=with_server.__doc__,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(with_server)


def main() -> None:
    """Run the CLI; errors a user can act on (bad config, corrupt cache, missing weights, I/O
    such as a full disk or a permission) print one line and exit != 0. `CREDITFLOW_DEBUG=1`
    shows the traceback instead."""
    if os.environ.get("CREDITFLOW_DEBUG"):
        app()
        return
    try:
        app()
    except CreditflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except OSError as exc:  # disk full, permissions, a vanished file
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

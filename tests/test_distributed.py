"""Several processes, one round (pipeline.distributed): sharding, the noise of a sharded rollout,
and — launched as 2 CPU processes over gloo by `accelerate launch` — group statistics and the
GRPO update across ranks against one process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import distributed, sampling
from pipeline.config import apply_overrides, load_config

WORKER = "tests.distributed_worker"  # run as a module from the repo root: this checkout's code
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("n", "count"), [(12, 2), (7, 3), (2, 4)])
def test_shards_cover_every_row_once_in_rank_order(n, count):
    shards = [distributed.shard(n, distributed.Ranks(i, count)) for i in range(count)]
    rows = [r for s in shards for r in range(n)[s]]
    assert rows == list(range(n))
    sizes = [len(range(n)[s]) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_one_process_is_single_and_never_starts_torch_distributed(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = distributed.current()
    assert ranks == distributed.SINGLE and ranks.is_main and not ranks.distributed
    values = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce(values, ranks) is values and values.tolist() == [1.0, 2.0]
    assert distributed.gather_objects("x", ranks) == ["x"]
    assert not torch.distributed.is_initialized()


def test_nccl_collectives_take_cpu_tensors_to_this_ranks_gpu_and_gloo_leaves_them(monkeypatch):
    cpu = torch.device("cpu")
    assert distributed.collective_device("gloo", cpu) == cpu
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert distributed.collective_device("nccl", cpu) == torch.device("cuda", 1)


@pytest.mark.parametrize("kind", ["flow_grpo", "stepwise"])
def test_sharded_rollout_draws_the_noise_one_process_draws(kind):
    """Each shard of a rollout (`noise_rows`) samples exactly the rows one process samples."""
    x_T = torch.randn(6, 2, 3, 3, generator=torch.Generator().manual_seed(1))
    sigmas = sampling.timesteps_sigmas(4, shift=1.0)
    window = torch.tensor([False, True, True, False])

    def velocity(x, sigma):  # row-wise, so batch composition cannot change a row's value
        return 0.5 * x - sigma.view(-1, 1, 1, 1)

    def run(x, rows=None):
        return sampling.sample(
            velocity, x, sigmas, kind=kind, eta=0.7, window=window,
            generator=torch.Generator().manual_seed(5), noise_rows=rows,
        )  # fmt: skip

    whole = run(x_T)
    for part in (slice(0, 4), slice(4, 6)):
        shard = run(x_T[part], (6, part))
        assert torch.equal(shard.states, whole.states[part])
        assert torch.equal(shard.log_probs.nan_to_num(), whole.log_probs[part].nan_to_num())
    with pytest.raises(ValueError, match="noise_rows"):
        run(x_T[:3], (6, slice(0, 4)))


def _launch(processes: int, *args: Path) -> subprocess.CompletedProcess:
    command, env = distributed.module_command(processes, WORKER, *map(str, args))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def _with_overrides(project: Path, *overrides: str) -> Path:
    """Rewrite `project`'s params.yaml for 12 trajectories a round (3 prompts x 4, so a group
    is split over 2 ranks), a dense reward and odd minibatches, plus `overrides`."""
    params = project / "params.yaml"
    sharded = [
        "rollout.prompts_per_round=3", "rollout.group_size=4", "update.minibatch_size=5",
        "update.lr=0.01", "score.rewards={brightness: 1.0}",
    ]  # fmt: skip
    tree = apply_overrides(yaml.safe_load(params.read_text()), [*sharded, *overrides])
    params.write_text(yaml.safe_dump(tree, sort_keys=False))
    return params


def test_multiprocess_update_and_group_credit_equal_one_process(tiny_project, tmp_path):
    """2 gloo processes, a prompt group split between them (12 trajectories of 3 groups of 4):
    both ranks compute the advantages of the whole round and take identical steps — the same
    LoRA weights and metrics as one process, to 1e-5."""
    from pipeline import layout, rounds
    from pipeline.policy import Policy
    from pipeline.rewards import RewardMix

    params = _with_overrides(
        tiny_project,
        "train.method=stepwise", "update.inner_epochs=2", "update.kl_beta=0.01",
    )  # fmt: skip
    cfg = load_config(params)
    policy = Policy.create(cfg)
    schedule = rounds.Schedule.from_config(cfg)
    prompts = layout.load_prompts(cfg, "train")
    counter = rounds.CountingVelocity(policy.backend, cfg.sampling.guidance)
    rollout = rounds.rollout_round(
        policy.backend, prompts, [0, 3, 7], schedule, cfg, method="stepwise", seed=0,
        round_index=0, run_id="t", model_version="t", counter=counter,
    )  # fmt: skip
    scores = rounds.score_round(
        policy.backend, rollout, layout.trajectory_metadata(cfg, rollout),
        RewardMix(cfg, cfg.score.rewards), cfg, estimators=rounds.estimators_for("stepwise", cfg),
        schedule=schedule, counter=counter,
    )  # fmt: skip
    saved = tmp_path / "round.pt"
    torch.save(
        {
            "method": "stepwise", "table": scores.table, "group_ids": rollout.group_ids,
            "states": rollout.states, "log_probs": rollout.log_probs, "sigmas": rollout.sigmas,
            "prompts": rollout.prompts, "advantages": torch.zeros(12, schedule.steps.numel()),
        },
        saved,
    )  # fmt: skip

    for processes in (1, 2):
        done = _launch(processes, saved, params, tmp_path / str(processes))
        assert done.returncode == 0, done.stderr[-3000:]
    one = torch.load(tmp_path / "1" / "rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / "2" / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    assert [r["rows"] for r in ranks] == [(0, 6), (6, 12)]  # group 1 (rows 4-7) is split
    for rank in ranks:
        torch.testing.assert_close(rank["advantages"], one["advantages"], rtol=0, atol=1e-6)
        assert rank["metrics"].keys() == one["metrics"].keys()
        for key, value in one["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        for name, weight in one["lora"].items():
            torch.testing.assert_close(rank["lora"][name], weight, rtol=1e-5, atol=1e-5)
    moved = [n for n, w in one["lora"].items() if not torch.equal(w, ranks[0]["lora"][n] * 0)]
    assert moved, "the update moved no LoRA weight"
    for name, weight in ranks[0]["lora"].items():  # gradients were synchronised
        assert torch.equal(weight, ranks[1]["lora"][name]), name


def _command(processes: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """`creditflow ARGS` (module `stages.cli` of this checkout), alone or under `accelerate
    launch`, and its environment."""
    command, env = distributed.module_command(processes, "stages.cli", *args)
    return command, env | {"PYTHONPATH": str(REPO), "CREDITFLOW_ORCHESTRATION": "inline"}


TRAIN = ("train", "--method", "stepwise", "--seed", "0")  # the run every multi-process test trains


def _train(processes: int, project: Path, *extra: str) -> None:
    _cli(processes, project, *TRAIN, *extra)


def _cli(processes: int, project: Path, *args: str) -> None:
    command, env = _command(processes, *args)
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, cwd=project
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def sharded_project(tiny_project) -> Path:
    """The tiny project with a prompt group split over 2 ranks and a dense reward, 2 rounds."""
    _with_overrides(tiny_project, "score.estimator=tweedie", "train.rounds=2", "train.eval_every=0")
    return tiny_project


def _lora(project: Path, round_index: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    checkpoint = project / "data/train/stepwise-s0/checkpoints" / f"round-{round_index:04d}"
    return load_file(checkpoint / "lora.safetensors")


def _assert_same_weights(ours: dict, reference: dict, tolerance: float = 1e-5) -> None:
    assert ours.keys() == reference.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(ours[name], weight, rtol=tolerance, atol=tolerance)


def test_multiprocess_training_equals_one_process(sharded_project, tmp_path):
    """`creditflow train` under `accelerate launch` with 2 gloo processes: the same rounds,
    checkpoints (LoRA weights to 1e-5) and per-round metrics as one process, one writer."""
    import json
    import shutil

    from stages.flows import run_stage

    projects = {n: tmp_path / f"p{n}" for n in (1, 2)}
    for project in projects.values():
        shutil.copytree(sharded_project, project)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same summation order in the matmuls
    try:
        run_stage("train", load_config(projects[1] / "params.yaml", ["train.method=stepwise"]))
    finally:
        torch.set_num_threads(threads)
    _train(2, projects[2])
    for r in (0, 1):
        _assert_same_weights(_lora(projects[2], r), _lora(projects[1], r))
    curves = [json.loads((p / "reports/train/stepwise-s0/rounds.json").read_text()) for p in
              projects.values()]  # fmt: skip
    assert len(curves[0]) == len(curves[1]) == 2
    for one, two in zip(*curves, strict=True):
        for key, value in one.items():
            if key.startswith(("reward/", "credit/", "train/", "cost/")):
                assert two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_multiprocess_run_resumes_after_kill_9_of_a_rank_and_of_the_launcher(
    sharded_project, tmp_path
):
    """SIGKILL of one rank mid-run stops the whole job with one clear line from the survivor,
    not a traceback; SIGKILL of the launcher takes its ranks with it (nothing keeps training the
    run). Neither leaves a partial round, and the relaunched job resumes to the weights of an
    uninterrupted one-process run."""
    import shutil

    from stages.flows import run_stage

    reference = tmp_path / "reference"
    shutil.copytree(sharded_project, reference)
    done, err = _kill_9_mid_run(sharded_project, tmp_path / "stderr", "rank 1", past_round=1)
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, err[-3000:]
    assert "rank" in said[0] and "rerun the same command to resume" in said[0]
    assert "[rank0]: Traceback" not in err
    done, _ = _kill_9_mid_run(sharded_project, tmp_path / "stderr", "launcher", past_round=done)

    _train(2, sharded_project, "-S", f"train.rounds={done + 1}")
    overrides = ["train.method=stepwise", "train.seed=0", f"train.rounds={done + 1}"]
    run_stage("train", load_config(reference / "params.yaml", overrides))
    # 1e-4: summation-order rounding of 1 vs 2 processes compounds over the 4+ rounds; a resume
    # that lost or redid a step would be off by about the learning rate (1e-2)
    _assert_same_weights(_lora(sharded_project, done), _lora(reference, done), tolerance=1e-4)


def _kill_9_mid_run(project: Path, log: Path, victim: str, past_round: int) -> tuple[int, str]:
    """Launch a long 2-process train of `project`, SIGKILL `victim` (`launcher` | `rank 1`)
    once round `past_round` is checkpointed, check that no rank outlives the job and that every
    round directory left is a complete checkpoint; the rounds done and the job's stderr."""
    import signal
    import time

    from pipeline.policy import checkpoints

    saved = project / "data/train/stepwise-s0/checkpoints"
    command, env = _command(2, *TRAIN, "-S", "train.rounds=60")
    with open(log, "w") as stderr:  # a file: a full pipe would stall the ranks
        launcher = subprocess.Popen(
            command, env=env, cwd=project, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (saved / f"round-{past_round:04d}" / "metrics.json").exists():
        assert launcher.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks = _ranks_of(launcher.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(launcher.pid if victim == "launcher" else ranks[1], signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks.values()):
        assert time.monotonic() < deadline, "ranks outlived their job"
        time.sleep(0.1)
    done = len(checkpoints(saved))
    assert sorted(path.name for path in saved.iterdir()) == [f"round-{r:04d}" for r in range(done)]
    assert past_round < done < 60
    return done, log.read_text()


def test_multiprocess_evaluate_and_rescore_equal_one_process(sharded_project, tmp_path):
    """`evaluate` and `rescore` under 2 gloo processes (each samples or scores a shard, the main
    rank gathers and writes): the same verdicts, GenEval summary and score tables as one."""
    import json
    import shutil

    from pipeline.trajectories import SCORES, list_rounds, read_scores
    from stages.flows import run_stage

    _with_overrides(sharded_project, "evaluate.images_per_prompt=3")  # 12 x 3: odd shards
    cfg = load_config(sharded_project / "params.yaml", ["train.method=stepwise"])
    run_stage("train", cfg)  # cached rounds to re-score
    projects = {1: sharded_project, 2: tmp_path / "p2"}
    shutil.copytree(sharded_project, projects[2])
    rescore = {"rollouts": Path("data/train/stepwise-s0/rollouts"), "rewards": "geneval",
               "out": Path("data/rescored")}  # fmt: skip
    run_stage("evaluate", cfg, policy="stepwise-s0")  # one process: this one
    run_stage("rescore", cfg, **rescore)
    _cli(2, projects[2], "evaluate", "--policy", "stepwise-s0")
    _cli(2, projects[2], "rescore", *[f"--{k}={v}" for k, v in rescore.items()])
    one, two = projects[1], projects[2]
    verdicts = "data/eval/stepwise-s0/results.jsonl"
    assert (one / verdicts).read_text() == (two / verdicts).read_text()
    assert len((one / verdicts).read_text().splitlines()) == 36
    summary = "reports/eval/stepwise-s0/metrics.json"
    assert json.loads((one / summary).read_text()) == json.loads((two / summary).read_text())
    rescored = list_rounds(one / "data/rescored", SCORES)
    assert rescored == list_rounds(two / "data/rescored", SCORES) == [0, 1]
    for r in rescored:
        ours, theirs = (read_scores(p / "data/rescored", r) for p in (one, two))
        assert ours.drop(columns="value").equals(theirs.drop(columns="value"))
        assert ours.value.to_numpy() == pytest.approx(theirs.value.to_numpy(), abs=1e-6)


def _ranks_of(launcher: int) -> dict[int, int]:
    """{rank: pid} of the processes `launcher` started (torch elastic puts each in a session
    of its own, so they are found by parent, and their rank in their environment)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:  # field 4: ppid
                continue
            environ = (stat.parent / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in environ.split("\0") if "=" in item)
        found[int(env["RANK"])] = int(stat.parent.name)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

"""What a killed command leaves behind is cleared by the next one: half-written files, the
orphaned Prefect server, the MLflow run left RUNNING."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow

from pipeline.config import load_config
from pipeline.io import atomic_path, clear_stale_writes, pid_alive
from pipeline.leftovers import (
    HOST_TAG,
    OWNER_ENV,
    PID_TAG,
    SERVER_MARK,
    run_owner_tags,
    stop_orphan_prefect_servers,
)
from pipeline.tracking import stage_run


def dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(child.stdout)
    assert not pid_alive(pid)
    return pid


def test_a_killed_writers_partial_output_is_removed_and_a_moved_aside_result_restored(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    result = tmp_path / "round-0003"
    (tmp_path / f".round-0003.old-{dead}").mkdir()  # killed between the two renames
    (tmp_path / f".round-0003.old-{dead}" / "lora.safetensors").write_text("finished")
    (tmp_path / f".round-0003.tmp-{dead}").mkdir()  # its unfinished replacement
    (tmp_path / f".other.tmp-{dead}").write_text("another path's leftover")
    live_writer = tmp_path / f".round-0003.tmp-{alive}"  # a writer still at work
    live_writer.write_text("a running writer's file")

    clear_stale_writes(result)
    assert (result / "lora.safetensors").read_text() == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["round-0003", f".other.tmp-{dead}", live_writer.name]
    )

    (tmp_path / f".round-0003.old-{dead}").mkdir()  # the new result made it: old is obsolete
    with atomic_path(result) as tmp:
        tmp.mkdir()
    assert not (tmp_path / f".round-0003.old-{dead}").exists() and not any(result.iterdir())


def fake_server(owner: int) -> subprocess.Popen:
    """A process that looks like Prefect's temporary server started by `owner`."""
    env = os.environ | {OWNER_ENV: str(owner)}
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", SERVER_MARK.decode()], env=env
    )


def wait_for_exec(pid: int, timeout_s: float = 30.0) -> None:
    """Until `pid` runs its own command line (a loaded machine can take seconds to exec)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    deadline = time.monotonic() + timeout_s
    while SERVER_MARK not in cmdline.read_bytes():
        assert time.monotonic() < deadline, f"process {pid} did not exec in {timeout_s} s"
        time.sleep(0.05)


def test_an_orphaned_prefect_server_is_stopped_and_a_live_owners_left_alone():
    orphan, owned = fake_server(dead_pid()), fake_server(os.getpid())
    try:
        for process in (orphan, owned):  # exec'd: /proc cmdline and environ are final
            wait_for_exec(process.pid)
        stopped = stop_orphan_prefect_servers(grace_s=5)
        assert orphan.pid in stopped and owned.pid not in stopped
        assert orphan.wait(timeout=10) is not None
        assert owned.poll() is None
    finally:
        for process in (orphan, owned):
            process.kill()
            process.wait()


def test_a_killed_commands_mlflow_run_is_marked_killed_by_the_next(project, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'runs.db'}")
    cfg = load_config(project / "params.yaml")
    with stage_run(cfg, "prompts") as first:
        experiment = first.info.experiment_id
    client = mlflow.tracking.MlflowClient()
    tags = run_owner_tags()
    killed = client.create_run(experiment, tags=tags | {PID_TAG: str(dead_pid())}).info.run_id
    other_host = client.create_run(
        experiment, tags={PID_TAG: str(dead_pid()), HOST_TAG: tags[HOST_TAG] + "-elsewhere"}
    ).info.run_id
    with stage_run(cfg, "prompts") as second:
        assert client.get_run(second.info.run_id).data.tags[PID_TAG] == str(os.getpid())
        assert client.get_run(second.info.run_id).info.status == "RUNNING"
    assert client.get_run(killed).info.status == "KILLED"
    assert client.get_run(other_host).info.status == "RUNNING"  # not ours to judge

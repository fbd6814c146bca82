"""What a killed command (kill -9, OOM) leaves behind, found and cleared by the next one.

- Prefect's temporary API server is a child process (uvicorn) that outlives a killed parent and
  holds ~230 MB. Every creditflow process marks its environment with its pid before Prefect starts
  the server, which inherits it; a server whose marked owner is gone is an orphan.
- The MLflow run of a killed stage stays RUNNING. Runs are tagged with their process and host;
  one still RUNNING whose process is gone is marked KILLED.
- Half-written files: `pipeline.io.clear_stale_writes`, run by every atomic write.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from pipeline.io import pid_alive

OWNER_ENV = "CREDITFLOW_OWNER_PID"
SERVER_MARK = b"prefect.server.api.server:create_app"  # on the temporary server's command line
PID_TAG = "creditflow.pid"
HOST_TAG = "creditflow.host"


def claim_prefect_server() -> None:
    """Mark this process as the owner of any Prefect server it starts from now on."""
    os.environ[OWNER_ENV] = str(os.getpid())


def orphan_prefect_servers(proc: Path = Path("/proc")) -> list[int]:
    """Pids of temporary Prefect servers whose creditflow owner process is gone (Linux /proc)."""
    orphans = []
    for entry in proc.glob("[0-9]*"):
        try:
            if SERVER_MARK not in (entry / "cmdline").read_bytes():
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        prefix = f"{OWNER_ENV}=".encode()
        owner = next((e[len(prefix) :] for e in environ if e.startswith(prefix)), b"")
        if owner.isdigit() and not pid_alive(int(owner)):
            orphans.append(int(entry.name))
    return orphans


def stop_orphan_prefect_servers(grace_s: float = 5.0) -> list[int]:
    """SIGTERM every orphan server, SIGKILL those still there after `grace_s`; returns pids."""
    orphans = orphan_prefect_servers()
    for pid in orphans:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(pid) for pid in orphans) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in orphans:
        _signal(pid, signal.SIGKILL)
    return orphans


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_owner_tags() -> dict[str, str]:
    """Tags that let a later command tell whether an MLflow run's process is still alive."""
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}


def mark_killed_runs(client, experiment_id: str) -> list[str]:
    """Set every RUNNING run of this host whose process is gone to KILLED; returns their ids."""
    running = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = "
        f"'{socket.gethostname()}'",
    )
    killed = [
        run.info.run_id
        for run in running
        if run.data.tags.get(PID_TAG, "").isdigit() and not pid_alive(int(run.data.tags[PID_TAG]))
    ]
    for run_id in killed:
        client.set_terminated(run_id, status="KILLED")
    return killed

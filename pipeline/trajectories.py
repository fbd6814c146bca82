"""Parquet cache of rollouts and scores (DESIGN.md, "Parquet trajectory cache").

Layout under a cache root, hive-partitioned by round (the round is in the path, not in the files,
as Hive readers expect), a few files per round:

    <root>/steps/round=<r>/part-00000.parquet     one row per (trajectory, step)
    <root>/finals/round=<r>/part-00000.parquet    one row per trajectory
    <root>/scores/round=<r>/part-00000.parquet    one row per (trajectory, step, estimator, reward)
    <root>/estimate_images/round=<r>/...          decoded x0 estimates of a few trajectories
    <root>/<table>/round=<r>/_manifest.json       written last: the round is complete

Tensor columns are Arrow fixed-shape tensors (one tensor per row, shape and value type kept in the
column type), so a round trip is bit-exact. Files are zstd-compressed.

Atomicity: every file is written under a hidden temporary name (``.part-00000.parquet.tmp-<pid>``)
in its final directory and renamed into place, so no reader ever sees half a file. A round of a
table counts only once its manifest (file names, sizes, sha256, schema version) exists; a
rewrite deletes the manifest first. A killed write therefore leaves earlier rounds untouched and
its own round unreadable (a clear error), never a silently partial one. Leftover temporary files
are hidden from ``pyarrow.dataset`` discovery (leading dot) and removed by the next write of
that round. One writer per round is assumed. Read through this module (``open_dataset``,
``read_*``): a plain ``pq.read_table(<root>/steps)`` would also pick up the complete parts of an
incomplete round.

A rollout is complete when its *steps* manifest exists: ``write_rollout`` invalidates both
manifests, then writes finals, then steps.

Indices: ``trajectory`` is the position of a trajectory within its round (0..N-1). In the steps
table ``step`` t is the transition from state t to state t+1 (x = state t, x_next = state t+1).
In the score table ``step`` is a *state* index 0..T: state 0 is pure noise (sigma = 1), state T
the final sample; the estimator ``"final"`` scores the decoded final image at step T.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import torch

from pipeline.config import CreditflowError
from pipeline.io import atomic_path

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"creditflow.schema_version"
TABLE_KEY = b"creditflow.table"
# bfloat16 has no numpy dtype: it is stored as its int16 bit pattern, the field says so.
TORCH_DTYPE_KEY = b"creditflow.torch_dtype"

STEPS = "steps"
FINALS = "finals"
SCORES = "scores"
ESTIMATE_IMAGES = "estimate_images"

MANIFEST_NAME = "_manifest.json"
SCORE_KEY = ("trajectory", "step", "estimator", "reward")
DEFAULT_FILE_BYTES = 256 * 2**20  # uncompressed bytes per file: "a few files per round"

_ROUND_DIR = re.compile(r"^round=(\d+)$")
# What read_rollout needs: x_next repeats x and the finals' latent, so it is not read.
_ROLLOUT_STEP_COLUMNS = [
    "trajectory",
    "step",
    "sigma",
    "sigma_next",
    "is_sde",
    "x",
    "mean",
    "std",
    "log_prob",
]
VELOCITY_COLUMN = "velocity"  # optional: the model velocity the sampler used at x


class TrajectoryCacheError(CreditflowError, RuntimeError):
    """A cache round is missing, incomplete, truncated, or written by an unknown schema."""


@dataclass
class RoundRollout:
    """All trajectories of one round, as the sampler produced them.

    N = trajectories, T = steps, (C, H, W) = latent shape, (3, Hi, Wi) = image shape.

    Tensors (any float dtype, including bfloat16, is stored bit-exactly):
        states:    (N, T+1, C, H, W)  x_0 (noise, sigma = 1) .. x_T (sample, sigma = 0)
        means:     (N, T, C, H, W)    mean of the Gaussian step t -> t+1
        stds:      (N, T)             its std (0 for ODE steps)
        log_probs: (N, T)             log-prob of x_{t+1}, mean over non-batch dims
        sigmas:    (T+1,)             noise levels, shared by all trajectories
        window:    (T,) bool          step t is an SDE (trained) step
        images:    (N, 3, Hi, Wi)     decoded final images in [0, 1]
        group_ids, sample_idx, seeds: (N,) int64
        velocities: (N, T, C, H, W)   the (guided) model velocity at each state, as sampled;
                                      None for caches written before it was kept (schema 1
                                      made it optional); clean-image estimates reuse it
    """

    run_id: str
    round: int
    method: str
    sampler: str
    eta: float
    model_version: str
    states: torch.Tensor
    means: torch.Tensor
    stds: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    window: torch.Tensor
    images: torch.Tensor
    prompt_ids: list[str]
    prompts: list[str]
    tags: list[str]
    group_ids: torch.Tensor
    sample_idx: torch.Tensor
    seeds: torch.Tensor
    velocities: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, t_plus_1 = self.states.shape[:2]
        t = t_plus_1 - 1
        latent = tuple(self.states.shape[2:])
        expected = {
            "means": (n, t, *latent),
            "stds": (n, t),
            "log_probs": (n, t),
            "sigmas": (t + 1,),
            "window": (t,),
            "group_ids": (n,),
            "sample_idx": (n,),
            "seeds": (n,),
        }
        if self.velocities is not None:
            expected["velocities"] = (n, t, *latent)
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, want {shape}"
                )
        if self.images.ndim != 4 or self.images.shape[0] != n:
            raise ValueError(f"images has shape {tuple(self.images.shape)}, want ({n}, 3, H, W)")
        if self.window.dtype != torch.bool:
            raise ValueError(f"window must be bool, got {self.window.dtype}")
        for name in ("prompt_ids", "prompts", "tags"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, want {n}")
        if n == 0 or t == 0:
            raise ValueError("a rollout needs at least one trajectory and one step")

    @property
    def num_trajectories(self) -> int:
        return self.states.shape[0]

    def rows(self, part: slice) -> RoundRollout:
        """The trajectories `part` of this round (a rank's shard), sharing its tensors."""
        per_row = {name: getattr(self, name)[part] for name in _ROW_FIELDS}
        if self.velocities is not None:
            per_row["velocities"] = self.velocities[part]
        return replace(self, **per_row)

    @classmethod
    def concat(cls, shards: Sequence[RoundRollout]) -> RoundRollout:
        """One round from its shards, in order (what the ranks sampled, gathered)."""
        first = shards[0]
        joined = {
            name: (
                torch.cat([getattr(s, name) for s in shards])
                if isinstance(getattr(first, name), torch.Tensor)
                else [v for s in shards for v in getattr(s, name)]
            )
            for name in _ROW_FIELDS
        }
        if first.velocities is not None:
            joined["velocities"] = torch.cat([s.velocities for s in shards])
        return replace(first, **joined)

    @property
    def num_steps(self) -> int:
        return self.states.shape[1] - 1


# per-trajectory fields (dim 0 or list index = trajectory); velocities may be None
_ROW_FIELDS = (
    "states", "means", "stds", "log_probs", "images", "prompt_ids", "prompts", "tags",
    "group_ids", "sample_idx", "seeds",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# tensors <-> Arrow


def _column_from_tensor(name: str, values: torch.Tensor) -> tuple[pa.Field, pa.Array]:
    """(rows, *shape) tensor -> Arrow column: fixed-shape tensor if it has a per-row shape."""
    values = values.detach().cpu().contiguous()
    metadata = None
    if values.dtype == torch.bfloat16:
        values = values.view(torch.int16)
        metadata = {TORCH_DTYPE_KEY: b"bfloat16"}
    array = values.numpy()
    if array.ndim == 1:
        arrow = pa.array(array)
    else:
        arrow = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(array))
    return pa.field(name, arrow.type, metadata=metadata), arrow


def tensor_column(table: pa.Table, name: str) -> torch.Tensor:
    """Arrow column -> torch tensor (rows, *shape), bit-exact, dtype as written."""
    field = table.schema.field(name)
    if isinstance(field.type, pa.FixedShapeTensorType):
        chunks = [chunk.to_numpy_ndarray() for chunk in table.column(name).chunks]
    else:
        chunks = [chunk.to_numpy(zero_copy_only=False) for chunk in table.column(name).chunks]
    # One copy into memory torch owns: Arrow's buffers are read-only.
    values = torch.from_numpy(np.concatenate(chunks) if len(chunks) != 1 else chunks[0].copy())
    if field.metadata and field.metadata.get(TORCH_DTYPE_KEY) == b"bfloat16":
        values = values.view(torch.bfloat16)
    return values


def _make_table(name: str, columns: list[tuple[pa.Field, pa.Array]]) -> pa.Table:
    metadata = {SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: name.encode()}
    fields, arrays = zip(*columns, strict=True)
    return pa.Table.from_arrays(list(arrays), schema=pa.schema(fields, metadata=metadata))


def _column(name: str, values, arrow_type: pa.DataType) -> tuple[pa.Field, pa.Array]:
    """A column of fixed Arrow type (ids, names): values are cast, overflow is an error."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    return pa.field(name, arrow_type), pa.array(values, type=arrow_type)


# ---------------------------------------------------------------------------------------------
# atomic files and manifests


def round_dir(root: Path, table: str, round: int) -> Path:
    return Path(root) / table / f"round={round}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary sibling of ``path``, fsync, rename into place."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _invalidate(directory: Path, overwrite: bool) -> None:
    """Make a round directory empty and incomplete before a (re)write."""
    if (directory / MANIFEST_NAME).exists() and not overwrite:
        raise FileExistsError(f"{directory} is already complete; pass overwrite=True to replace it")
    (directory / MANIFEST_NAME).unlink(missing_ok=True)  # first: the round is now incomplete
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.iterdir():  # parts and temp files of earlier attempts
        leftover.unlink()


def _write_round(
    directory: Path, table_name: str, round: int, parts: Iterable[pa.Table]
) -> list[Path]:
    """Write parts (built one at a time if a generator) then the manifest.

    The directory must already be invalidated (``_invalidate``).
    """
    entries, paths = [], []
    for index, part in enumerate(parts):
        path = directory / f"part-{index:05d}.parquet"
        _atomic_write(
            path, lambda f, part=part: pq.write_table(part, f, **_parquet_options(part.schema))
        )
        entries.append(
            {
                "name": path.name,
                "rows": part.num_rows,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )
        paths.append(path)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "table": table_name,
        "round": round,
        "rows": sum(entry["rows"] for entry in entries),
        "files": entries,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _atomic_write(directory / MANIFEST_NAME, lambda f: f.write(text))
    return paths


def _parquet_options(schema: pa.Schema) -> dict:
    """zstd everywhere; tensor and float columns BYTE_STREAM_SPLIT-encoded, without dictionary.

    Dictionary encoding is useless on float data and, when on, pre-empts BYTE_STREAM_SPLIT, which
    groups the bytes of each value by significance: measured on a ShapesWorld round it made
    files 17% smaller and writes and reads 2-3x faster (benchmarks/parquet_io.py).
    """
    numeric, leaf_paths = [], []
    for field in schema:
        if isinstance(field.type, pa.FixedShapeTensorType):
            numeric.append(field.name)
            leaf_paths.append(f"{field.name}.list.element")  # Parquet's compliant list layout
        elif pa.types.is_floating(field.type):
            numeric.append(field.name)
            leaf_paths.append(field.name)
    return {
        "compression": "zstd",
        "use_dictionary": [name for name in schema.names if name not in numeric],
        "use_byte_stream_split": leaf_paths,
    }


def _load_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_NAME
    if not path.exists():
        state = (
            "incomplete (no manifest: an interrupted write?)" if directory.exists() else "absent"
        )
        raise TrajectoryCacheError(f"{directory} is {state}")
    manifest = json.loads(path.read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise TrajectoryCacheError(
            f"{path} has schema version {manifest.get('schema_version')!r}; "
            f"this code reads version {SCHEMA_VERSION}"
        )
    return manifest


def _complete_files(root: Path, table: str, round: int) -> list[Path]:
    """Files of a complete round, each checked against the manifest (size, then sha256 of every
    byte: same-size corruption is caught on read) and its schema version."""
    directory = round_dir(root, table, round)
    manifest = _load_manifest(directory)
    paths = []
    for entry in manifest["files"]:
        path = directory / entry["name"]
        if not path.exists():
            raise TrajectoryCacheError(f"{path} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise TrajectoryCacheError(
                f"{path} is {size} bytes, the manifest says {entry['bytes']}: truncated or altered"
            )
        try:
            metadata = pq.read_schema(path).metadata or {}
        except (pa.ArrowException, OSError) as error:
            raise TrajectoryCacheError(f"{path} is not a readable Parquet file: {error}") from error
        version = metadata.get(SCHEMA_VERSION_KEY)
        if version != str(SCHEMA_VERSION).encode():
            raise TrajectoryCacheError(
                f"{path} has schema version {version!r}; this code reads version {SCHEMA_VERSION}"
            )
        if sha256_file(path) != entry["sha256"]:
            raise TrajectoryCacheError(
                f"{path} does not match the sha256 in its manifest: corrupted on disk"
            )
        paths.append(path)
    return paths


def cached_rounds(root: Path, table: str = STEPS) -> list[int]:
    """Rounds of a table with a directory, complete or not, ascending."""
    base = Path(root) / table
    if not base.exists():
        return []
    found = (_ROUND_DIR.match(child.name) for child in base.iterdir())
    return sorted(int(match.group(1)) for match in found if match)


def list_rounds(root: Path, table: str = STEPS) -> list[int]:
    """Complete rounds of a table, ascending (for ``steps``: complete rollouts)."""
    rounds = cached_rounds(root, table)
    return [r for r in rounds if (round_dir(root, table, r) / MANIFEST_NAME).exists()]


def open_dataset(root: Path, table: str = STEPS, rounds: Sequence[int] | None = None) -> ds.Dataset:
    """Lazy ``pyarrow.dataset`` over the complete rounds of a table (all of them by default).

    Read only what is needed, e.g. for scoring:
    ``open_dataset(root).to_table(columns=["trajectory", "step", "sigma", "x"],
    filter=ds.field("is_sde"))``. Only files listed in manifests are opened.
    """
    rounds = list_rounds(root, table) if rounds is None else list(rounds)
    files = [str(path) for r in rounds for path in _complete_files(root, table, r)]
    if not files:
        raise TrajectoryCacheError(f"{Path(root) / table} has no complete round among {rounds}")
    partitioning = ds.partitioning(pa.schema([("round", pa.int32())]), flavor="hive")
    return ds.dataset(
        files,
        format="parquet",
        partitioning=partitioning,
        partition_base_dir=str(Path(root) / table),
    )


def _read_table(
    root: Path,
    table: str,
    round: int,
    columns: list[str] | None = None,
    optional: Sequence[str] = (),
) -> pa.Table:
    """One complete round of a table, files in manifest order, ``round`` as the first column.

    ``columns`` (default all) must exist; the ``optional`` ones are added where the files have
    them (columns a later writer added).
    """
    parts = []
    files = _complete_files(root, table, round)
    if columns is not None and optional and files:
        present = pq.read_schema(files[0]).names
        columns = columns + [name for name in optional if name in present]
    for path in files:
        try:
            parts.append(pq.read_table(path, columns=columns, partitioning=None))
        except (pa.ArrowException, OSError) as error:
            raise TrajectoryCacheError(f"{path} could not be read: {error}") from error
    combined = pa.concat_tables(parts)
    return combined.add_column(0, "round", pa.array(np.full(combined.num_rows, round), pa.int32()))


def sha256_tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, keyed by its relative POSIX path."""
    path = Path(path)
    return {
        file.relative_to(path).as_posix(): sha256_file(file)
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


# ---------------------------------------------------------------------------------------------
# rollouts


def _trajectory_chunks(n: int, bytes_per_trajectory: int, file_bytes: int) -> list[range]:
    """Split trajectories 0..n-1 into contiguous ranges of about ``file_bytes`` each."""
    per_file = max(1, file_bytes // max(1, bytes_per_trajectory))
    return [range(start, min(start + per_file, n)) for start in range(0, n, per_file)]


def _steps_table(rollout: RoundRollout, rows: range) -> pa.Table:
    """Steps table of trajectories ``rows``: one row per (trajectory, step), trajectory-major."""
    n, t, s = len(rows), rollout.num_steps, slice(rows.start, rows.stop)
    states = rollout.states[s]  # (n, T+1, C, H, W)
    latent = states.shape[2:]

    def per_trajectory(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(t)  # (n,) -> (n*T,)

    def per_step(values: torch.Tensor) -> torch.Tensor:
        return values.repeat(n)  # (T,) -> (n*T,)

    return _make_table(
        STEPS,
        [
            _column("run_id", [rollout.run_id] * (n * t), pa.string()),
            _column("trajectory", per_trajectory(torch.arange(rows.start, rows.stop)), pa.int32()),
            _column("prompt_id", np.repeat(rollout.prompt_ids[s], t), pa.string()),
            _column("group_id", per_trajectory(rollout.group_ids[s]), pa.int64()),
            _column("sample_idx", per_trajectory(rollout.sample_idx[s]), pa.int32()),
            _column("seed", per_trajectory(rollout.seeds[s]), pa.int64()),
            _column("step", per_step(torch.arange(t)), pa.int32()),
            _column_from_tensor("sigma", per_step(rollout.sigmas[:-1])),
            _column_from_tensor("sigma_next", per_step(rollout.sigmas[1:])),
            _column_from_tensor("is_sde", per_step(rollout.window)),
            _column_from_tensor("x", states[:, :-1].reshape(n * t, *latent)),  # (n*T, C, H, W)
            _column_from_tensor("x_next", states[:, 1:].reshape(n * t, *latent)),  # (n*T, C, H, W)
            _column_from_tensor("mean", rollout.means[s].reshape(n * t, *latent)),  # (n*T, C, H, W)
            _column_from_tensor("std", rollout.stds[s].reshape(n * t)),  # (n*T,)
            _column_from_tensor("log_prob", rollout.log_probs[s].reshape(n * t)),  # (n*T,)
            _column("method", [rollout.method] * (n * t), pa.string()),
            _column("sampler", [rollout.sampler] * (n * t), pa.string()),
            _column("eta", np.full(n * t, rollout.eta), pa.float64()),
            _column("model_version", [rollout.model_version] * (n * t), pa.string()),
        ]
        + (
            []
            if rollout.velocities is None
            else [
                _column_from_tensor(VELOCITY_COLUMN, rollout.velocities[s].reshape(n * t, *latent))
            ]
        ),
    )


def _finals_table(rollout: RoundRollout, rows: range) -> pa.Table:
    """Finals table of trajectories ``rows``: one row per trajectory."""
    n, s = len(rows), slice(rows.start, rows.stop)
    return _make_table(
        FINALS,
        [
            _column("run_id", [rollout.run_id] * n, pa.string()),
            _column("trajectory", torch.arange(rows.start, rows.stop), pa.int32()),
            _column("prompt_id", rollout.prompt_ids[s], pa.string()),
            _column("group_id", rollout.group_ids[s], pa.int64()),
            _column("sample_idx", rollout.sample_idx[s], pa.int32()),
            _column("seed", rollout.seeds[s], pa.int64()),
            _column("prompt", rollout.prompts[s], pa.string()),
            _column("tag", rollout.tags[s], pa.string()),
            _column_from_tensor("image", rollout.images[s]),  # (n, 3, Hi, Wi)
            _column_from_tensor("latent", rollout.states[s, -1]),  # (n, C, H, W)
            _column("method", [rollout.method] * n, pa.string()),
            _column("sampler", [rollout.sampler] * n, pa.string()),
            _column("eta", np.full(n, rollout.eta), pa.float64()),
            _column("model_version", [rollout.model_version] * n, pa.string()),
        ],
    )


def write_rollout(
    root: Path,
    rollout: RoundRollout,
    *,
    file_bytes: int = DEFAULT_FILE_BYTES,
    overwrite: bool = False,
) -> list[Path]:
    """Write one round's finals then steps tables; returns the Parquet files written.

    Files hold whole trajectories, about ``file_bytes`` uncompressed each. Raises
    ``FileExistsError`` if the round is already complete and ``overwrite`` is false.
    """
    steps_dir = round_dir(root, STEPS, rollout.round)
    finals_dir = round_dir(root, FINALS, rollout.round)
    # The steps manifest marks the rollout complete: removed first, written last.
    _invalidate(steps_dir, overwrite)
    _invalidate(finals_dir, overwrite=True)
    # x, x_next, mean (and velocity): T tensors each
    per_trajectory = (3 + (rollout.velocities is not None)) * rollout.means[0].numel()
    chunks = _trajectory_chunks(
        rollout.num_trajectories, per_trajectory * rollout.states.element_size(), file_bytes
    )
    finals = _write_round(
        finals_dir, FINALS, rollout.round, (_finals_table(rollout, rows) for rows in chunks)
    )
    steps = _write_round(
        steps_dir, STEPS, rollout.round, (_steps_table(rollout, rows) for rows in chunks)
    )
    return finals + steps


def _check_order(round: int, table: pa.Table, keys: dict[str, np.ndarray]) -> None:
    for name, expected in keys.items():
        if not np.array_equal(table.column(name).to_numpy(), expected):
            raise TrajectoryCacheError(f"round {round}: rows are not in (trajectory, step) order")


def read_rollout(root: Path, round: int) -> RoundRollout:
    """Read back a complete round written by ``write_rollout``, bit-exact.

    Raises ``TrajectoryCacheError`` (naming the file) for a missing or incomplete round, a
    truncated file, or an unknown schema version.
    """
    # Manifest order is trajectory-major.
    # Caches written before rollouts kept their velocities lack that column.
    steps = _read_table(
        root, STEPS, round, columns=_ROLLOUT_STEP_COLUMNS, optional=[VELOCITY_COLUMN]
    )
    has_velocity = VELOCITY_COLUMN in steps.column_names
    finals = _read_table(root, FINALS, round)
    n = finals.num_rows
    t = steps.num_rows // max(n, 1)
    if steps.num_rows != n * t or t == 0:
        raise TrajectoryCacheError(
            f"round {round}: {steps.num_rows} step rows for {n} trajectories"
        )
    _check_order(round, finals, {"trajectory": np.arange(n)})
    _check_order(
        round, steps, {"trajectory": np.repeat(np.arange(n), t), "step": np.tile(np.arange(t), n)}
    )

    x = tensor_column(steps, "x")
    latent = x.shape[1:]
    x = x.reshape(n, t, *latent)  # (N, T, C, H, W)
    x_last = tensor_column(finals, "latent")[:, None]  # (N, 1, C, H, W)
    sigma = tensor_column(steps, "sigma").reshape(n, t)
    sigma_next = tensor_column(steps, "sigma_next").reshape(n, t)
    sigmas = torch.cat([sigma[0], sigma_next[0, -1:]])  # (T+1,)
    if not (sigma == sigma[0]).all():
        raise TrajectoryCacheError(f"round {round}: trajectories disagree on their sigmas")
    first = finals.slice(0, 1).to_pylist()[0]
    return RoundRollout(
        run_id=first["run_id"],
        round=round,
        method=first["method"],
        sampler=first["sampler"],
        eta=first["eta"],
        model_version=first["model_version"],
        states=torch.cat([x, x_last], dim=1),  # (N, T+1, C, H, W)
        means=tensor_column(steps, "mean").reshape(n, t, *latent),  # (N, T, C, H, W)
        velocities=(
            tensor_column(steps, VELOCITY_COLUMN).reshape(n, t, *latent) if has_velocity else None
        ),
        stds=tensor_column(steps, "std").reshape(n, t),
        log_probs=tensor_column(steps, "log_prob").reshape(n, t),
        sigmas=sigmas,
        window=tensor_column(steps, "is_sde").reshape(n, t)[0],
        images=tensor_column(finals, "image"),  # (N, 3, Hi, Wi)
        prompt_ids=finals.column("prompt_id").to_pylist(),
        prompts=finals.column("prompt").to_pylist(),
        tags=finals.column("tag").to_pylist(),
        group_ids=tensor_column(finals, "group_id"),
        sample_idx=tensor_column(finals, "sample_idx").long(),
        seeds=tensor_column(finals, "seed"),
    )


# ---------------------------------------------------------------------------------------------
# scores and estimate images


def _frame_table(name: str, round: int, frame: pd.DataFrame, tensors: dict | None = None):
    """DataFrame (+ tensor columns) -> Arrow table with our metadata; round lives in the path."""
    if "round" in frame.columns:
        if not (frame["round"] == round).all():
            raise ValueError(f"rows of another round than {round} in a round-{round} table")
        frame = frame.drop(columns="round")
    table = pa.Table.from_pandas(frame, preserve_index=False)
    columns = [(field, table.column(field.name).combine_chunks()) for field in table.schema]
    columns += [_column_from_tensor(key, value) for key, value in (tensors or {}).items()]
    return _make_table(name, columns)


def write_scores(root: Path, round: int, scores: pd.DataFrame, *, overwrite: bool = False) -> Path:
    """Write one round's score table; returns its file.

    ``scores`` columns: trajectory (int, index within the round), step (int, state index 0..T),
    estimator (str: "final", "tweedie", "ode_substeps", "ode_completion", ...), reward (str),
    value (float); any further columns (e.g. n_substeps) are kept. (trajectory, step, estimator,
    reward) must be unique. Rows are stored sorted by that key.
    """
    missing = {*SCORE_KEY, "value"} - set(scores.columns)
    if missing:
        raise ValueError(f"score table lacks columns {sorted(missing)}")
    duplicated = scores.duplicated(list(SCORE_KEY), keep=False)
    if duplicated.any():
        raise ValueError(f"duplicate score keys:\n{scores.loc[duplicated, list(SCORE_KEY)].head()}")
    frame = scores.astype(
        {
            "trajectory": "int32",
            "step": "int32",
            "estimator": str,
            "reward": str,
            "value": "float64",
        }
    )
    frame = frame.sort_values(list(SCORE_KEY), kind="stable").reset_index(drop=True)
    directory = round_dir(root, SCORES, round)
    _invalidate(directory, overwrite)
    return _write_round(directory, SCORES, round, [_frame_table(SCORES, round, frame)])[0]


def read_scores(root: Path, round: int | None = None) -> pd.DataFrame:
    """Score table of one round, or of every complete round, with a round column; sorted."""
    rounds = list_rounds(root, SCORES) if round is None else [round]
    if not rounds:
        raise TrajectoryCacheError(f"{Path(root) / SCORES} has no complete round")
    frame = pa.concat_tables([_read_table(root, SCORES, r) for r in rounds]).to_pandas()
    return frame.sort_values(["round", *SCORE_KEY], kind="stable").reset_index(drop=True)


def write_estimate_images(
    root: Path, round: int, images: torch.Tensor, keys: pd.DataFrame, *, overwrite: bool = False
) -> Path:
    """Store decoded estimate images (M, 3, H, W) of a few trajectories, one row per key row.

    ``keys`` has M rows, e.g. columns trajectory, step, estimator; kept as given.
    """
    if len(keys) != images.shape[0]:
        raise ValueError(f"{len(keys)} key rows for {images.shape[0]} images")
    directory = round_dir(root, ESTIMATE_IMAGES, round)
    _invalidate(directory, overwrite)
    table = _frame_table(ESTIMATE_IMAGES, round, keys.reset_index(drop=True), {"image": images})
    return _write_round(directory, ESTIMATE_IMAGES, round, [table])[0]


def read_estimate_images(root: Path, round: int) -> tuple[pd.DataFrame, torch.Tensor]:
    """Keys (with round) and images (M, 3, H, W) stored by ``write_estimate_images``."""
    table = _read_table(root, ESTIMATE_IMAGES, round)
    keys = table.drop_columns(["image"]).to_pandas()
    return keys, tensor_column(table, "image")


def advantages_file(run: Path, round_index: int) -> Path:
    return Path(run) / "advantages" / f"round={round_index}.parquet"


def read_advantages(run: Path, round_index: int) -> torch.Tensor:
    """(N, K) advantages of a round, as the update consumes them."""
    table = pd.read_parquet(advantages_file(run, round_index))
    wide = table.pivot(index="trajectory", columns="k", values="advantage")
    return torch.from_numpy(wide.to_numpy(dtype=np.float32, copy=True))


def prune_rollouts(run: Path, keep: int) -> None:
    """Drop the cached states of all but the newest `keep` rounds (0 keeps all)."""
    if keep == 0:
        return
    for r in list_rounds(run / "rollouts", STEPS)[:-keep]:
        shutil.rmtree(round_dir(run / "rollouts", STEPS, r))

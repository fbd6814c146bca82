"""Parquet trajectory cache: bit-exact round trips, layout, atomicity, clear errors."""

import json
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import trajectories as tj
from pipeline.trajectories import (
    FINALS,
    STEPS,
    RoundRollout,
    TrajectoryCacheError,
    list_rounds,
    open_dataset,
    read_estimate_images,
    read_rollout,
    read_scores,
    round_dir,
    sha256_tree,
    tensor_column,
    write_estimate_images,
    write_rollout,
    write_scores,
)

N, T, LATENT, IMAGE = 5, 3, (2, 3, 5), (3, 4, 6)  # odd shapes on purpose
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
# Special values; the NaN has a non-default payload, which only a bit-exact path keeps.
SPECIAL_BITS = {
    torch.float32: [0x7FC0_1234, 0x7F80_0000, -0x0080_0000, -(2**31), 0x0000_0001],
    torch.float64: [0x7FF8_0000_0000_1234, 0x7FF0 << 48, -(0x0010 << 48), -(2**63), 1],
    torch.bfloat16: [0x7FC3, 0x7F80, -0x0080, -(2**15), 0x0001],
}  # NaN, +inf, -inf, -0.0, smallest subnormal


def _tensor(generator: torch.Generator, shape, dtype) -> torch.Tensor:
    values = torch.randn(shape, generator=generator).to(dtype)
    special = torch.tensor(SPECIAL_BITS[dtype], dtype=BITS[dtype]).view(dtype)
    values.view(-1)[: special.numel()] = special
    return values


def make_rollout(round: int, dtype=torch.float32, step_dtype=None, seed: int = 0) -> RoundRollout:
    """Random rollout with special values; states, images in dtype; step stats in step_dtype."""
    g = torch.Generator().manual_seed(seed + round)
    step_dtype = step_dtype or dtype
    return RoundRollout(
        run_id="run-a",
        round=round,
        method="stepwise",
        sampler="stepwise",
        eta=0.7,
        model_version="base@r0",
        states=_tensor(g, (N, T + 1, *LATENT), dtype),
        means=_tensor(g, (N, T, *LATENT), step_dtype),
        stds=_tensor(g, (N, T), step_dtype),
        log_probs=_tensor(g, (N, T), step_dtype),
        sigmas=torch.linspace(1, 0, T + 1, dtype=step_dtype),
        window=torch.tensor([False, True, False]),
        images=_tensor(g, (N, *IMAGE), dtype),
        prompt_ids=[f"p{i // 2}" for i in range(N)],
        prompts=[f"a photo of {i // 2} cats" for i in range(N)],
        tags=["counting"] * N,
        group_ids=torch.arange(N) // 2,
        sample_idx=torch.arange(N) % 2,
        seeds=torch.arange(N) + 2**40,
        velocities=_tensor(g, (N, T, *LATENT), step_dtype),
    )


def assert_same_rollout(a: RoundRollout, b: RoundRollout) -> None:
    assert (a.velocities is None) == (b.velocities is None)
    for name in ("states", "means", "stds", "log_probs", "sigmas", "images", "velocities"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(BITS[x.dtype]), y.view(BITS[y.dtype])), name  # bit-exact
    for name in ("window", "group_ids", "sample_idx", "seeds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("run_id", "round", "method", "sampler", "eta", "model_version"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.prompt_ids, a.prompts, a.tags) == (b.prompt_ids, b.prompts, b.tags)


# Bytes of two trajectories of x, x_next, mean, velocity in fp32: three files of <= 2 trajectories.
TWO_TRAJECTORIES = 2 * 4 * T * int(np.prod(LATENT)) * 4


@pytest.mark.parametrize(
    ("dtype", "step_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # the sampler keeps states in the model dtype
    ],
)
def test_round_trip_is_bit_exact_for_every_tensor_column(tmp_path, dtype, step_dtype):
    rollout = make_rollout(2, dtype, step_dtype)
    write_rollout(tmp_path, rollout, file_bytes=TWO_TRAJECTORIES)
    back = read_rollout(tmp_path, 2)
    assert_same_rollout(rollout, back)
    assert back.states.view(BITS[dtype]).view(-1)[0] == SPECIAL_BITS[dtype][0]  # the NaN payload


def test_a_cache_without_velocities_reads_back_without_them(tmp_path):
    """Rounds cached before rollouts kept their velocities stay readable (and rescorable)."""
    rollout = make_rollout(1)
    rollout.velocities = None
    write_rollout(tmp_path, rollout)
    assert (
        "velocity"
        not in pq.read_schema(next(round_dir(tmp_path, STEPS, 1).glob("*.parquet"))).names
    )
    back = read_rollout(tmp_path, 1)
    assert back.velocities is None
    assert_same_rollout(rollout, back)


def test_layout_types_and_metadata(tmp_path):
    write_rollout(tmp_path, make_rollout(0), file_bytes=TWO_TRAJECTORIES)
    write_rollout(tmp_path, make_rollout(3))  # default size: one file for a small round
    assert list_rounds(tmp_path) == [0, 3]
    assert sorted(p.name for p in (tmp_path / STEPS).iterdir()) == ["round=0", "round=3"]
    parts = sorted(round_dir(tmp_path, STEPS, 0).glob("*.parquet"))
    assert [p.name for p in parts] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert len(list(round_dir(tmp_path, STEPS, 3).glob("*.parquet"))) == 1
    # Whole trajectories per file, in order.
    trajectories = [pq.read_table(p, columns=["trajectory"]).column(0).to_pylist() for p in parts]
    assert trajectories == [[0] * T + [1] * T, [2] * T + [3] * T, [4] * T]

    schema = pq.read_schema(parts[0])
    assert schema.metadata[b"creditflow.schema_version"] == b"1"
    assert "round" not in schema.names  # Hive: the round is in the path
    hive = pd.read_parquet(tmp_path / STEPS, columns=["round", "trajectory"])
    assert hive["round"].astype(int).value_counts().to_dict() == {0: N * T, 3: N * T}
    assert schema.field("x").type == pa.fixed_shape_tensor(pa.float32(), list(LATENT))
    assert schema.field("mean").type == pa.fixed_shape_tensor(pa.float32(), list(LATENT))
    columns = pq.ParquetFile(parts[0]).metadata.row_group(0).to_dict()["columns"]
    encodings = {c["path_in_schema"]: (c["compression"], c["encodings"]) for c in columns}
    assert encodings["x.list.element"] == ("ZSTD", ("RLE", "BYTE_STREAM_SPLIT"))
    assert encodings["log_prob"] == ("ZSTD", ("RLE", "BYTE_STREAM_SPLIT"))
    assert encodings["prompt_id"][0] == "ZSTD" and "RLE_DICTIONARY" in encodings["prompt_id"][1]
    finals = pq.read_schema(round_dir(tmp_path, FINALS, 0) / "part-00000.parquet")
    assert finals.field("image").type == pa.fixed_shape_tensor(pa.float32(), list(IMAGE))
    manifest = json.loads((round_dir(tmp_path, STEPS, 0) / "_manifest.json").read_text())
    assert manifest["rows"] == N * T and [f["rows"] for f in manifest["files"]] == [6, 6, 3]


def test_step_rows_follow_the_design_schema(tmp_path):
    rollout = make_rollout(1)
    write_rollout(tmp_path, rollout)
    table = pq.read_table(round_dir(tmp_path, STEPS, 1))
    row = table.slice(T + 1, 1).to_pylist()[0]  # trajectory 1, step 1
    assert (row["trajectory"], row["step"], row["group_id"], row["sample_idx"]) == (1, 1, 0, 1)
    assert (row["prompt_id"], row["seed"], row["is_sde"]) == ("p0", 2**40 + 1, True)
    assert (
        row["sigma"] == rollout.sigmas[1].item() and row["sigma_next"] == rollout.sigmas[2].item()
    )
    x = tensor_column(table, "x")[T + 1]
    x_next = tensor_column(table, "x_next")[T + 1]
    assert torch.equal(x.view(torch.int32), rollout.states[1, 1].view(torch.int32))
    assert torch.equal(x_next.view(torch.int32), rollout.states[1, 2].view(torch.int32))


def test_exception_midway_keeps_previous_round_and_leaves_no_half_file(tmp_path, monkeypatch):
    write_rollout(tmp_path, make_rollout(0))
    before = sha256_tree(tmp_path)
    real_write = pq.write_table
    calls = []

    def failing_write(table, where, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            where.write(b"PAR1 half a file")
            raise KeyboardInterrupt
        real_write(table, where, **kwargs)

    monkeypatch.setattr(tj.pq, "write_table", failing_write)
    with pytest.raises(KeyboardInterrupt):
        write_rollout(tmp_path, make_rollout(1), file_bytes=TWO_TRAJECTORIES)
    monkeypatch.undo()

    after = sha256_tree(tmp_path)
    assert {k: v for k, v in after.items() if "round=0" in k} == before
    assert sorted(k for k in after if "round=1" in k) == ["finals/round=1/part-00000.parquet"]
    assert list_rounds(tmp_path) == [0] and list_rounds(tmp_path, FINALS) == [0]
    with pytest.raises(TrajectoryCacheError, match=r"round=1 is incomplete"):
        read_rollout(tmp_path, 1)
    assert_same_rollout(read_rollout(tmp_path, 0), make_rollout(0))


def _write_and_die_on_rename(root: Path, die_at: int) -> None:
    """Child process: SIGKILL itself at the ``die_at``-th rename, a temp file fully written."""
    real_replace, calls = os.replace, []

    def dying_replace(src, dst):
        calls.append(dst)
        if len(calls) == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = dying_replace
    write_rollout(root, make_rollout(1), file_bytes=TWO_TRAJECTORIES)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_killed_write_leaves_previous_round_and_only_complete_files(tmp_path):
    write_rollout(tmp_path, make_rollout(0))
    before = sha256_tree(tmp_path)
    # Renames: 3 finals parts, finals manifest, then steps parts; die renaming the 2nd steps part.
    child = multiprocessing.get_context("fork").Process(
        target=_write_and_die_on_rename, args=(tmp_path, 6)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL

    steps_1 = round_dir(tmp_path, STEPS, 1)
    assert [p.name for p in steps_1.iterdir() if not p.name.startswith(".")] == [
        "part-00000.parquet"
    ]
    pq.read_table(steps_1 / "part-00000.parquet")  # the visible file is complete
    (leftover,) = [p for p in steps_1.iterdir() if p.name.startswith(".")]
    assert leftover.name.startswith(".part-00001.parquet.tmp-")
    assert {k: v for k, v in sha256_tree(tmp_path).items() if "round=0" in k} == before
    assert list_rounds(tmp_path) == [0]
    with pytest.raises(TrajectoryCacheError, match="incomplete"):
        read_rollout(tmp_path, 1)
    assert open_dataset(tmp_path).count_rows() == N * T  # round 0 only

    write_rollout(tmp_path, make_rollout(1))  # a retry cleans up and completes
    assert not leftover.exists()
    assert_same_rollout(read_rollout(tmp_path, 1), make_rollout(1))


def test_truncated_file_is_a_clear_error(tmp_path):
    write_rollout(tmp_path, make_rollout(0), file_bytes=TWO_TRAJECTORIES)
    part = round_dir(tmp_path, STEPS, 0) / "part-00001.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(TrajectoryCacheError, match=r"part-00001\.parquet is \d+ bytes.*truncated"):
        read_rollout(tmp_path, 0)

    # Same size as the manifest says, but the footer is gone: Parquet's own error, wrapped.
    part.write_bytes(data[:-8] + b"\0" * 8)
    with pytest.raises(
        TrajectoryCacheError, match=r"part-00001\.parquet is not a readable Parquet"
    ):
        read_rollout(tmp_path, 0)


def test_same_size_corruption_is_caught_on_read_naming_the_file(tmp_path):
    write_rollout(tmp_path, make_rollout(0), file_bytes=TWO_TRAJECTORIES)
    part = round_dir(tmp_path, STEPS, 0) / "part-00001.parquet"
    data = bytearray(part.read_bytes())
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(pq.read_schema(part).names.index("x"))
    # Inside the state column's data (not the footer, whose damage the schema read reports).
    start = chunk.data_page_offset
    for offset in (start + 16, start + chunk.total_compressed_size // 2):
        flipped = data.copy()
        flipped[offset] ^= 0x01
        part.write_bytes(bytes(flipped))
        with pytest.raises(TrajectoryCacheError, match=r"part-00001\.parquet does not match"):
            read_rollout(tmp_path, 0)
    part.write_bytes(bytes(data))
    assert_same_rollout(read_rollout(tmp_path, 0), make_rollout(0))


def test_unknown_schema_version_is_a_clear_error(tmp_path):
    write_rollout(tmp_path, make_rollout(0))
    directory = round_dir(tmp_path, FINALS, 0)
    part = directory / "part-00000.parquet"
    table = pq.read_table(part)
    metadata = {**table.schema.metadata, b"creditflow.schema_version": b"99"}
    pq.write_table(table.replace_schema_metadata(metadata), part, compression="zstd")
    manifest_path = directory / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][0]["bytes"] = part.stat().st_size  # only the version is wrong now
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        TrajectoryCacheError, match=r"finals/round=0/part-00000.parquet has schema version b'99'"
    ):
        read_rollout(tmp_path, 0)

    manifest["schema_version"] = 2
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(TrajectoryCacheError, match=r"_manifest.json has schema version 2"):
        read_rollout(tmp_path, 0)


def test_rewrite_needs_overwrite_and_drops_stale_files(tmp_path):
    write_rollout(tmp_path, make_rollout(0), file_bytes=TWO_TRAJECTORIES)
    with pytest.raises(FileExistsError):
        write_rollout(tmp_path, make_rollout(0, seed=5))
    write_rollout(tmp_path, make_rollout(0, seed=5), overwrite=True)
    assert sorted(p.name for p in round_dir(tmp_path, STEPS, 0).iterdir()) == [
        "_manifest.json",
        "part-00000.parquet",
    ]
    assert_same_rollout(read_rollout(tmp_path, 0), make_rollout(0, seed=5))


def test_dataset_reads_only_requested_columns_of_complete_rounds(tmp_path):
    rollouts = [make_rollout(r) for r in range(2)]
    for rollout in rollouts:
        write_rollout(tmp_path, rollout, file_bytes=TWO_TRAJECTORIES)
    (round_dir(tmp_path, STEPS, 1) / "_manifest.json").unlink()  # round 1 now incomplete
    dataset = open_dataset(tmp_path)
    table = dataset.to_table(
        columns=["round", "trajectory", "step", "x"], filter=ds.field("is_sde")
    )
    assert table.column_names == ["round", "trajectory", "step", "x"]
    assert (
        table.column("round").to_pylist() == [0] * N and table.column("step").to_pylist() == [1] * N
    )
    x = tensor_column(table, "x")  # (N, C, H, W): state 1 of every trajectory of round 0
    assert torch.equal(x.view(torch.int32), rollouts[0].states[:, 1].view(torch.int32))
    assert open_dataset(tmp_path, FINALS).count_rows() == 2 * N  # finals of round 1 complete


def _scores(rng: np.random.Generator, rewards=("geneval",)) -> pd.DataFrame:
    rows = [
        (traj, step, estimator, reward, rng.normal(), substeps)
        for traj in range(N)
        for reward in rewards
        for step, estimator, substeps in [(T, "final", 0)]
        + [(s, "tweedie", 1) for s in range(T)]
        + [(s, "ode_substeps", 4) for s in range(T)]
    ]
    columns = ["trajectory", "step", "estimator", "reward", "value", "n_substeps"]
    return pd.DataFrame(rows, columns=columns).sample(frac=1, random_state=0)  # unsorted


def test_scores_round_trip_and_rescoring_keeps_rollouts_byte_identical(tmp_path):
    write_rollout(tmp_path, make_rollout(0))
    rollout_hashes = sha256_tree(tmp_path)
    scores = _scores(np.random.default_rng(0))
    scores.loc[scores.index[0], "value"] = np.nan
    write_scores(tmp_path, 0, scores)
    write_scores(tmp_path, 4, _scores(np.random.default_rng(1)))

    back = read_scores(tmp_path, 0)
    expected = scores.sort_values(list(tj.SCORE_KEY)).reset_index(drop=True)
    assert back.columns.tolist() == ["round", *expected.columns]
    assert (back["round"] == 0).all()
    for column in expected.columns:
        np.testing.assert_array_equal(back[column].to_numpy(), expected[column].to_numpy())
    assert back["value"].dtype == np.float64
    assert read_scores(tmp_path)["round"].unique().tolist() == [0, 4]

    previous = read_scores(tmp_path, 0).drop(columns="round")
    rescored = pd.concat([previous, _scores(np.random.default_rng(2), ["clip"])])
    write_scores(tmp_path, 0, rescored, overwrite=True)
    assert set(read_scores(tmp_path, 0)["reward"]) == {"geneval", "clip"}
    after = sha256_tree(tmp_path)
    assert {k: after[k] for k in rollout_hashes} == rollout_hashes


def test_score_table_rejects_duplicate_keys_and_missing_columns(tmp_path):
    scores = _scores(np.random.default_rng(0))
    with pytest.raises(ValueError, match="duplicate score keys"):
        write_scores(tmp_path, 0, pd.concat([scores, scores.iloc[:1]]))
    with pytest.raises(ValueError, match=r"lacks columns \['value'\]"):
        write_scores(tmp_path, 0, scores.drop(columns="value"))
    with pytest.raises(ValueError, match="another round"):
        write_scores(tmp_path, 0, scores.assign(round=1))
    assert list_rounds(tmp_path, tj.SCORES) == []


def test_estimate_images_round_trip(tmp_path):
    images = torch.rand(4, *IMAGE)
    keys = pd.DataFrame(
        {"trajectory": [0, 0, 3, 3], "step": [1, 2, 1, 2], "estimator": ["tweedie"] * 4}
    )
    write_estimate_images(tmp_path, 2, images, keys)
    back_keys, back_images = read_estimate_images(tmp_path, 2)
    assert back_keys["round"].tolist() == [2] * 4
    assert back_keys[keys.columns].equals(keys.astype(back_keys[keys.columns].dtypes))
    assert torch.equal(back_images.view(torch.int32), images.view(torch.int32))


def test_rollout_shapes_are_checked():
    rollout = make_rollout(0)
    with pytest.raises(ValueError, match=r"means has shape"):
        RoundRollout(**{**rollout.__dict__, "means": rollout.means[:, :-1]})
    with pytest.raises(ValueError, match="window must be bool"):
        RoundRollout(**{**rollout.__dict__, "window": rollout.window.int()})

"""Bad input, one case at a time: a clear error, and nothing valid lost.

Each case checks the error's class and the words of its message that tell the user what was
found and what to do, then that the state and the checkpoint are as they were.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from xxhash import xxh3_64_hexdigest

import unickpt
from tests.distributed import start_process
from tests.integrity._helpers import (
    debris,
    metadata_path,
    read_metadata,
    read_only_view,
    repin,
    same_tensor,
    small_tmpfs,
    tmp_files,
)
from tests.integrity._procs import SaverServer, wait_for_line
from tests.integrity._saver_script import build_state, check_step, set_step
from unickpt.format.metadata import FORMAT_VERSION


def _model_state(fill: float = 1.0) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((4, 3), fill), "b": torch.arange(5) + int(fill)},
        "step": int(fill),
    }


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}, "step": -1}


def _holds(state: dict[str, Any], fill: float) -> bool:
    want = _model_state(fill)
    return (
        same_tensor(state["model"]["w"], want["model"]["w"])
        and same_tensor(state["model"]["b"], want["model"]["b"])
        and state["step"] == want["step"]
    )


def _loads(path: Path, fill: float) -> bool:
    state = _blank()
    unickpt.load(path, state)
    return _holds(state, fill)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    unickpt.save(path, _model_state(1.0))
    return path


def test_missing_key(saved: Path) -> None:
    state = _blank()
    state["model"]["extra"] = torch.full((2,), 7.0)
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(saved, state)
    message = str(info.value)
    assert "the state has keys the checkpoint lacks: 'model.extra'" in message
    assert "strict=False" in message
    assert same_tensor(state["model"]["w"], torch.zeros(4, 3)), "a refused load changed the state"
    assert state["step"] == -1

    with pytest.warns(UserWarning, match=r"keeps its current value: 'model.extra'"):
        report = unickpt.load(saved, state, strict=False)
    assert report.skipped_keys == ("model.extra",)
    assert same_tensor(state["model"]["extra"], torch.full((2,), 7.0))
    assert same_tensor(state["model"]["w"], torch.full((4, 3), 1.0)) and state["step"] == 1


def test_unexpected_key_and_partial_load(saved: Path) -> None:
    state = {"model": {"w": torch.zeros(4, 3)}, "step": -1}
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(saved, state)
    assert "the checkpoint has keys the state lacks: 'model.b'" in str(info.value)
    assert "strict=False" in str(info.value)
    assert same_tensor(state["model"]["w"], torch.zeros(4, 3)) and state["step"] == -1

    warned = r"strict=False: 'model': 1 tensor \(40 B\) not loaded \(not in the state\): 'model.b'"
    with pytest.warns(UserWarning, match=warned):
        report = unickpt.load(saved, state, strict=False)
    assert report.unread_keys == ("model.b",) and report.skipped_keys == ()
    assert same_tensor(state["model"]["w"], torch.full((4, 3), 1.0)) and state["step"] == 1
    assert _loads(saved, 1.0)


def test_shape_mismatch(saved: Path) -> None:
    state = _blank()
    state["model"]["w"] = torch.zeros(4, 4)
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(saved, state)
    message = str(info.value)
    assert "'model.w' has global shape [4, 3] in the checkpoint but [4, 4] in the state" in message
    assert same_tensor(state["model"]["b"], torch.zeros(5, dtype=torch.int64))
    assert _loads(saved, 1.0)


def test_dtype_mismatch(saved: Path) -> None:
    state = _blank()
    state["model"]["w"] = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(unickpt.CheckpointMismatchError) as info:
        unickpt.load(saved, state)
    message = str(info.value)
    assert "'model.w' is float32 in the checkpoint but float64 in the state" in message
    assert "dtype float32" in message
    assert same_tensor(state["model"]["w"], torch.zeros(4, 3, dtype=torch.float64))


def test_tensor_where_a_value_was_saved(saved: Path) -> None:
    state = _blank()
    state["step"] = torch.zeros(())
    with pytest.raises(unickpt.CheckpointMismatchError, match="'step' is a tensor in the state"):
        unickpt.load(saved, state)


def test_path_that_does_not_exist(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "ckpt"
    with pytest.raises(unickpt.CheckpointNotFoundError) as info:
        unickpt.load(path, _blank())
    assert f"no checkpoint at {path}" in str(info.value)
    assert "Check the path" in str(info.value)
    assert not path.exists() and not path.parent.exists(), "a load created folders"


def test_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(unickpt.CheckpointNotFoundError) as info:
        unickpt.load(tmp_path, _blank())
    assert "is not a unickpt checkpoint" in str(info.value)
    assert "notes.txt" in str(info.value) and "COMMIT" in str(info.value)
    assert (tmp_path / "notes.txt").read_text() == "hello"


def test_folder_with_an_unfinished_save(saved: Path) -> None:
    (saved / "COMMIT").unlink()
    with pytest.raises(unickpt.CheckpointNotFoundError) as info:
        unickpt.load(saved, _blank())
    assert "incomplete save" in str(info.value) and "did not finish" in str(info.value)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a folder")
    with pytest.raises(unickpt.CheckpointNotFoundError, match=r"model\.pt"):
        unickpt.load(path, _blank())


@pytest.mark.parametrize("where", ["both", "commit", "metadata", "index"])
def test_newer_format_version(saved: Path, where: str) -> None:
    if where in ("both", "metadata"):
        doc = read_metadata(saved)
        doc["version"] = 99
        metadata_path(saved).write_bytes(json.dumps(doc).encode())
    if where == "index":
        index = saved / read_metadata(saved)["files"][0]["index"]
        doc = json.loads(index.read_bytes())
        doc["version"] = 99
        index.write_bytes(json.dumps(doc).encode())
    repin(saved, {"version": 99} if where in ("both", "commit") else None)
    with pytest.raises(unickpt.CheckpointVersionError) as info:
        unickpt.load(saved, _blank())
    message = str(info.value)
    assert "format version 99" in message and f"reads versions up to {FORMAT_VERSION}" in message
    assert "Upgrade unickpt" in message


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("version", 0, f"the format version 0 is not one unickpt writes (1 to {FORMAT_VERSION})"),
        ("save_id", "0123456789ab", "names save '0123456789ab' but metadata file 'metadata-"),
    ],
)
def test_commit_fields_that_no_save_writes(saved: Path, field: str, value: Any, says: str) -> None:
    """A marker whose version or save id changed (one flipped bit) is damage, not a checkpoint
    that loads: the save id names the data files a memory tier copies."""
    repin(saved, {field: value})
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(saved, _blank())
    assert says in str(info.value) and "COMMIT" in str(info.value)


def test_save_onto_a_committed_checkpoint(saved: Path) -> None:
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    with pytest.raises(unickpt.CheckpointExistsError) as info:
        unickpt.save(saved, _model_state(2.0))
    message = str(info.value)
    assert "already holds a committed checkpoint" in message and "overwrite=True" in message
    assert {p.name: p.read_bytes() for p in saved.iterdir() if p.name != "LOCK"} == {
        k: v for k, v in before.items() if k != "LOCK"
    }
    assert _loads(saved, 1.0)

    unickpt.save(saved, _model_state(2.0), overwrite=True)
    assert _loads(saved, 2.0)
    assert debris(saved) == [] and tmp_files(saved) == []


def test_old_checkpoint_survives_a_killed_overwrite(
    tmp_path: Path, saver_server: SaverServer
) -> None:
    """Overwrites killed at a few instants (test_crash.py does it at random, many times)."""
    path = tmp_path / "ckpt"
    state = build_state()
    set_step(state, 1)
    unickpt.save(path, state)
    outcomes = []
    for i, delay_s in enumerate((0.0, 0.01, 0.04, 0.1)):
        report = tmp_path / f"report-{i}.txt"
        pid = saver_server.start("single", path, report, 100 * (i + 1), 0)
        time.sleep(delay_s)
        assert saver_server.kill(pid)["signal"] == signal.SIGKILL
        set_step(state, -7)
        unickpt.load(path, state)
        step, wrong = check_step(state)
        assert wrong == []
        assert step == 1 or step >= 100 * (i + 1)
        outcomes.append(step)
        set_step(state, 1)
        unickpt.save(path, state, overwrite=True)
    print(f"killed overwrites loaded steps {outcomes} (1 is the old checkpoint)")


def test_two_checkpointers_on_one_root(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first = unickpt.Checkpointer(root)
    try:
        first.save(1, _model_state(1.0)).wait()
        second = unickpt.Checkpointer(root)  # a reader: lists and loads beside the writer
        state = _blank()
        assert second.steps() == [1] and second.load_latest(state) == 1 and _holds(state, 1.0)
        with pytest.raises(unickpt.CheckpointLockedError) as info:
            second.save(2, _model_state(2.0))
        message = str(info.value)
        assert f"is being written by pid {os.getpid()}" in message
        assert "two jobs must not save into the same place" in message
        first.save(2, _model_state(2.0)).wait()
    finally:
        first.close()
    with unickpt.Checkpointer(root) as third:
        state = _blank()
        assert third.load_latest(state) == 2 and _holds(state, 2.0)
        third.save(3, _model_state(3.0)).wait()  # the lock was released by close()


def test_two_processes_on_one_root(tmp_path: Path, saver_server: SaverServer) -> None:
    root = tmp_path / "run"
    report = tmp_path / "report.txt"
    pid = saver_server.start("hold", root, report, 0, 0)
    try:
        wait_for_line(report, "locked", timeout_s=30)
        with pytest.raises(unickpt.CheckpointLockedError, match=f"pid {pid} "):
            unickpt.Checkpointer(root).save(1, _model_state(1.0))
        assert unickpt.Checkpointer(root).steps() == [0], "a reader works beside the writer"
    finally:
        assert saver_server.kill(pid)["signal"] == 9
    with unickpt.Checkpointer(root) as ckpt:  # the lock died with its holder
        ckpt.save(3, _model_state(3.0)).wait()
        assert ckpt.steps() == [0, 3]


def test_a_reader_process_beside_a_writer_process(
    tmp_path: Path, saver_server: SaverServer
) -> None:
    """An evaluation job lists and loads while training saves: it never meets the writer's
    lock, and every checkpoint it loads is whole."""
    root = tmp_path / "run"
    report = tmp_path / "report.txt"
    pid = saver_server.start("sync", root, report, 0, 0)
    loaded = []
    try:
        wait_for_line(report, "committed 1", timeout_s=60)
        reader = unickpt.Checkpointer(root)
        state = build_state()
        for _ in range(10):
            with warnings.catch_warnings():  # a step retention deletes while it is read
                warnings.simplefilter("ignore")
                step = reader.load_latest(state)
            assert step is not None
            got, wrong = check_step(state)
            assert got == step and wrong == []
            loaded.append(step)
        with pytest.raises(unickpt.CheckpointLockedError, match=f"pid {pid} "):
            reader.save(10_000, state)
    finally:
        assert saver_server.kill(pid)["signal"] == 9
    assert loaded == sorted(loaded) and loaded[-1] >= 1


def _big_state(mib: int) -> dict[str, Any]:
    return {"model": {"w": torch.ones(mib, 1 << 18), "b": torch.arange(5)}, "step": 2}


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_in_the_middle_of_a_save(tmp_path: Path, async_save: bool) -> None:
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        root = disk / "run"
        with unickpt.Checkpointer(root, mode="async" if async_save else "sync") as ckpt:
            ckpt.save(1, _model_state(1.0)).wait()
            with pytest.raises(unickpt.CheckpointError) as info:
                ckpt.save(2, _big_state(3))
                ckpt.wait()
            message = str(info.value)
            assert "the disk is full" in message and "No space left on device" in message
            assert ckpt.steps() == [1]
            state = _blank()
            assert ckpt.load_latest(state) == 1 and _holds(state, 1.0)
            ckpt.save(3, _model_state(3.0)).wait()  # the unfinished step 2 is cleared away
        names = sorted(p.name for p in root.iterdir())
        assert names == ["LOCK", "ROOT_ID", "step-000000001", "step-000000003"]
        assert tmp_files(root) == []


def test_disk_full_while_overwriting_keeps_the_old(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        path = disk / "ckpt"
        unickpt.save(path, _model_state(1.0))
        with pytest.raises(unickpt.CheckpointError, match="the disk is full"):
            unickpt.save(path, _big_state(3), overwrite=True)
        assert _loads(path, 1.0)
        unickpt.save(path, _model_state(2.0), overwrite=True)
        assert _loads(path, 2.0) and debris(path) == [] and tmp_files(path) == []


def test_read_only_folder(saved: Path, tmp_path: Path) -> None:
    with read_only_view(saved.parent, tmp_path / "ro") as view:
        ro = view / saved.name
        assert _loads(ro, 1.0), "a read-only checkpoint must load"
        with pytest.raises(unickpt.CheckpointError) as info:
            unickpt.save(view / "new", _model_state(2.0))
        assert "not writable" in str(info.value) and "Read-only file system" in str(info.value)
        with pytest.raises(unickpt.CheckpointError, match="not writable"):
            unickpt.save(ro, _model_state(2.0), overwrite=True)
        assert _loads(ro, 1.0)
    assert _loads(saved, 1.0)


def _forge_metadata(path: Path, change: Any) -> None:
    doc = read_metadata(path)
    change(doc)
    metadata_path(path).write_bytes(json.dumps(doc).encode())
    repin(path)


def _two_steps(root: Path) -> Path:
    """A root with steps 1 and 2 (fills 1.0 and 2.0); the folder of step 2."""
    with unickpt.Checkpointer(root) as ckpt:
        ckpt.save(1, _model_state(1.0)).wait()
        ckpt.save(2, _model_state(2.0)).wait()
    (step,) = [p for p in root.iterdir() if p.name.endswith("2")]
    return step


def _falls_back_to_step_1(root: Path, says: str) -> None:
    state = _blank()
    with unickpt.Checkpointer(root) as ckpt, pytest.warns(UserWarning, match=says):
        assert ckpt.load_latest(state) == 1
    assert _holds(state, 1.0)


def test_unknown_dtype_in_metadata(tmp_path: Path) -> None:
    """A dtype no torch has is damage (the load falls back), not a state to make anew."""
    step = _two_steps(tmp_path / "run")
    _forge_metadata(step, lambda d: d["tensors"]["model.w"].__setitem__("dtype", "notadtype"))
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(step, _blank())
    message = str(info.value)
    assert "the metadata names dtype 'notadtype' for key 'model.w'; known: " in message
    assert (
        "float16, float32, " in message and "the file is damaged or from a newer unickpt" in message
    )
    assert "create the state" not in message
    _falls_back_to_step_1(tmp_path / "run", "names dtype 'notadtype'")


@pytest.mark.parametrize("where", ["metadata", "index", "COMMIT"])
def test_json_nested_too_deep(tmp_path: Path, where: str) -> None:
    """JSON nested deeper than the parser goes is a damaged file, named, and the load falls
    back (it was a bare RecursionError)."""
    step = _two_steps(tmp_path / "run")
    deep = b"[" * 100_000 + b"]" * 100_000
    if where == "COMMIT":
        path = step / "COMMIT"
        path.write_bytes(path.read_bytes().replace(b'"format"', b'"deep": ' + deep + b', "format"'))
    elif where == "metadata":  # pinned in COMMIT without parsing it (repin would)
        path = metadata_path(step)
        raw = path.read_bytes().replace(b'"producer":', b'"deep":' + deep + b',"producer":')
        path.write_bytes(raw)
        commit = json.loads((step / "COMMIT").read_bytes())
        commit["metadata_nbytes"], commit["metadata_checksum"] = len(raw), xxh3_64_hexdigest(raw)
        (step / "COMMIT").write_text(json.dumps(commit))
    else:
        path = step / read_metadata(step)["files"][0]["index"]
        path.write_bytes(path.read_bytes().replace(b'"chunks":', b'"deep":' + deep + b',"chunks":'))
        repin(step)
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(step, _blank())
    message = str(info.value)
    assert f"{path.name}: expected JSON written by unickpt" in message
    assert "RecursionError" in message and "the file is damaged" in message
    _falls_back_to_step_1(tmp_path / "run", "RecursionError")


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("way", ["save", "async_save", "zero-stall", "dict with a tensor"])
def test_a_state_nested_900_deep_is_refused_naming_its_key(tmp_path: Path, way: str) -> None:
    """A list nested 900 deep (or dicts around a tensor) is refused naming its key, not with a
    bare RecursionError; one nested 100 deep saves and loads."""
    state = {**_model_state(), "deep": {"history": _nested(900)}}
    if way == "dict with a tensor":
        inner: Any = {"w": torch.ones(2)}
        for i in range(900):
            inner = {f"d{i % 10}": inner}
        state["deep"]["history"] = inner
    with pytest.raises(unickpt.CheckpointError) as info:
        if way == "save" or way == "dict with a tensor":
            unickpt.save(tmp_path / "c", state)
        else:
            unickpt.async_save(tmp_path / "c", state, zero_stall=way == "zero-stall").wait()
    assert "'deep.history" in str(info.value)
    assert "nests lists, tuples or dicts more than 100 deep" in str(info.value)
    assert not (tmp_path / "c" / "COMMIT").exists()
    ok = {**_model_state(), "deep": _nested(100)}
    unickpt.save(tmp_path / "ok", ok)
    loaded = {**_blank(), "deep": None}
    unickpt.load(tmp_path / "ok", loaded)
    assert loaded["deep"] == _nested(100)


def test_a_value_nested_deep_in_the_metadata_is_refused_naming_its_key(saved: Path) -> None:
    """A crafted metadata value nested 300 deep (JSON parses it; decoding it recursed past
    Python's limit) is damage naming the key."""

    def deep(doc: dict[str, Any]) -> None:
        value: Any = 1
        for _ in range(300):
            value = {"$list": [value]}
        doc["objects"]["step"] = value

    _forge_metadata(saved, deep)
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(saved, _blank())
    assert "value of 'step[0][0]" in str(info.value)
    assert "nests more than 100 deep, which unickpt never writes" in str(info.value)


def test_chunk_without_checksums(saved: Path) -> None:
    """A chunk whose checksums were emptied (its bytes then changed) would load unverified:
    refused, as is a chunk with more checksums than its segments."""
    index = saved / read_metadata(saved)["files"][0]["index"]
    doc = json.loads(index.read_bytes())
    chunk = next(c for c in doc["chunks"] if c[0] == "model.w")
    chunk[5] = []
    index.write_bytes(json.dumps(doc).encode())
    repin(saved)
    data = saved / read_metadata(saved)["files"][0]["data"]
    raw = bytearray(data.read_bytes())
    raw[chunk[3]] ^= 0xFF
    data.write_bytes(bytes(raw))
    state = _blank()
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(saved, state)
    message = str(info.value)
    assert f"{index.name}: the chunk of 'model.w' has no checksums; expected one per" in message
    assert same_tensor(state["model"]["w"], torch.zeros(4, 3))

    chunk[5] = ["0011223344556677", "8899aabbccddeeff"]
    index.write_bytes(json.dumps(doc).encode())
    repin(saved)
    with pytest.raises(unickpt.CheckpointCorruptError) as info:
        unickpt.load(saved, _blank())
    assert "2 checksums; its box and dtype need 48 bytes and 1 checksums" in str(info.value)


def _peak_mib() -> float:
    """This process's high-water mark of resident memory (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _measure_load(path: str, out: str) -> None:
    """In a process forked from the ranks' fork server (torch and unickpt imported): reset the
    high-water mark to what is resident now (writing 5 to clear_refs; ru_maxrss would count
    the fork server's memory, and it cannot be reset), load ``path`` into a small state and
    write "<MiB before> <peak MiB> <outcome>" to ``out``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _peak_mib()
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}, "step": -1}
    try:
        unickpt.load(path, state)
        outcome = "loaded"
    except unickpt.CheckpointError as e:
        outcome = f"{type(e).__name__}: {e}"
    Path(out).write_text(f"{before:.0f} {_peak_mib():.0f} {outcome}")


def _load_in_a_fresh_process(path: Path) -> str:
    """The line of :func:`_measure_load`, from a new process."""
    out = path.with_name("peak.txt")
    proc = start_process(_measure_load, str(path), str(out))
    proc.join(timeout=240)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"loading {path} did not end within 240 s")
    assert proc.exitcode == 0 and out.exists(), f"the loading process ended with {proc.exitcode}"
    return out.read_text()


_PIECE = 8 << 20


@functools.cache
def _zeros_packed(nbytes: int) -> str:
    """Base64 of ``nbytes`` (a multiple of 8 MiB) zero bytes, deflated (1000 times smaller).

    Deflating gigabytes takes seconds, so one 8 MiB piece is deflated and the stream repeats
    its bytes: after a full flush the compressor starts afresh, byte-aligned, so each further
    piece deflates to the same bytes. The stream ends with the Adler-32 of all the zeros
    (its sum A stays 1; B adds A once a byte)."""
    assert nbytes % _PIECE == 0, nbytes
    deflate = zlib.compressobj(9)
    first = deflate.compress(bytes(_PIECE)) + deflate.flush(zlib.Z_FULL_FLUSH)
    again = deflate.compress(bytes(_PIECE)) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush()[:-4] + (((nbytes % 65521) << 16) | 1).to_bytes(4, "big")
    packed = first + again * (nbytes // _PIECE - 1) + end
    return base64.b64encode(packed).decode("ascii")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("declared", ["few rows", "many rows"])
def test_chunk_map_that_inflates_to_gigabytes(saved: Path, declared: str) -> None:
    """A 3 MB metadata whose chunk map inflates to 2 GiB: refused before it is inflated, its
    cost bounded (peak memory of a fresh process, measured)."""
    gib = 1 << 30

    def bomb(doc: dict[str, Any]) -> None:
        layout = doc["chunk_map"]["layouts"][0]
        layout["coords"] = _zeros_packed(2 * gib)
        if declared == "many rows":  # as many rows as the zeros make, of two dimensions
            layout["ndim"], layout["rows"] = 2, 2 * gib // 32
            layout["files"] = _zeros_packed(2 * gib // 4)

    _forge_metadata(saved, bomb)
    assert metadata_path(saved).stat().st_size < 4_000_000
    before_mib, peak_mib, outcome = _load_in_a_fresh_process(saved).split(" ", 2)
    print(f"chunk map bomb ({declared}): peak {peak_mib} MiB, {before_mib} MiB before the load")
    assert outcome.startswith("CheckpointCorruptError: ")
    if declared == "few rows":
        assert "a chunk map layout holds more or fewer bytes than" in outcome
    else:
        assert "chunks, more than the 1 indexes of 183 bytes can list" in outcome
    assert int(peak_mib) < 500, outcome

"""Atomic, durable publication of directories (training_core.storage): staging folders swept,
digests that name changed files, damaged copies replaced, fsync before the rename."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest


def test_published_directories_name_the_files_that_changed_later(tmp_path):
    from training_core.storage import FILE_DIGESTS, changed_files, directory_digest

    folder = tmp_path / "d"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "a.parquet").write_bytes(b"aaaa")
    (folder / "manifest.json").write_text("{}")
    plain = directory_digest(folder)
    assert changed_files(folder) is None  # nothing recorded yet
    assert directory_digest(folder, record_files=True) == plain  # same digest: the record is hidden
    assert (folder / FILE_DIGESTS).is_file() and directory_digest(folder) == plain
    assert changed_files(folder) == []
    (folder / "train" / "a.parquet").write_bytes(b"aaab")
    (folder / "train" / "b.parquet").write_bytes(b"new")
    (folder / "manifest.json").unlink()
    assert changed_files(folder) == ["manifest.json (removed)", "train/a.parquet (changed)", "train/b.parquet (added)"]


def test_staging_folders_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from training_core.storage import staging_directory

    host = socket.gethostname()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".staging-{host}-{int(ended.stdout)}-abc"
    live = tmp_path / f".staging-{host}-{os.getppid()}-def"  # our parent: alive
    old = tmp_path / ".staging-0123456789abcdef"  # the earlier naming, from any host
    for folder in (dead, live, old):
        (folder / "train").mkdir(parents=True)
    os.utime(old / "train", (0, 0))  # untouched for longer than the 6 h limit
    os.utime(old, (0, 0))
    stalled = tmp_path / ".staging-other-host-1-ghi"  # another host's: only its age counts
    (stalled / "train").mkdir(parents=True)
    os.utime(stalled, (0, 0))  # the folder is old, but a file inside it is being written now
    with staging_directory(tmp_path) as staging:
        assert staging.name.startswith(f".staging-{host}-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, stalled.name])


# Killed after moving the old copy aside, while deleting it (seconds for a large model).
KILLED_WHILE_REMOVING_THE_OLD_COPY = """
import os, shutil, sys
from pathlib import Path
from training_core.storage import replace_directory, staging_directory
parent = Path(sys.argv[1])
with staging_directory(parent) as staging:
    (staging / "model.safetensors").write_bytes(b"new")
    shutil.rmtree = lambda *args, **kwargs: os._exit(9)
    replace_directory(staging, parent / "model")
"""


def test_an_old_copy_moved_aside_by_a_killed_writer_is_swept_with_its_staging_folder(tmp_path):
    import subprocess
    import sys

    from training_core.storage import staging_directory

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"old")
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_REMOVING_THE_OLD_COPY, str(tmp_path)],
                            cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert killed.returncode == 9
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and all(name.startswith(".staging-") for name in left)  # the new copy and the old
    with staging_directory(tmp_path):
        pass
    assert [p.name for p in tmp_path.iterdir()] == []  # not kept for 6 h: its writer is dead


def test_publishing_over_a_damaged_copy_replaces_it(tmp_path):
    from training_core.storage import PUBLISH_LOCK, directory_digest, publish_directory, staging_directory

    def publish() -> Path:
        with staging_directory(tmp_path) as staging:
            (staging / "part-0.parquet").write_bytes(b"rows")
            (staging / "part-1.parquet").write_bytes(b"more rows")
            digest = directory_digest(staging, record_files=True)
            return publish_directory(staging, tmp_path / digest[:16])

    final = publish()
    (final / "part-1.parquet").unlink()  # damaged after publication
    assert publish() == final
    assert (final / "part-1.parquet").read_bytes() == b"more rows"
    intact_inode = (final / "part-0.parquet").stat().st_ino
    assert publish() == final and (final / "part-0.parquet").stat().st_ino == intact_inode  # intact: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, PUBLISH_LOCK])  # the lock: kept, empty


# Two writers over one damaged copy, interleaved at the worst moment: the second moves the copy
# aside while the first is still reading it to judge it.
def test_a_writer_judging_a_damaged_copy_is_not_cut_off_by_another_replacing_it(tmp_path, monkeypatch):
    import contextlib
    import shutil
    import threading

    import xxhash

    from training_core.storage import changed_files, directory_digest, publish_directory, staging_directory

    files = {"part-0.parquet": b"rows", "part-1.parquet": b"more rows"}
    with contextlib.ExitStack() as stack:
        stagings = [stack.enter_context(staging_directory(tmp_path)) for _ in range(3)]
        for staging in stagings:
            for name, data in files.items():
                (staging / name).write_bytes(data)
            digest = directory_digest(staging, record_files=True)
        final = tmp_path / digest[:16]
        earlier, judging, replacing = stagings
        publish_directory(earlier, final)
        (final / "part-1.parquet").write_bytes(b"")  # damaged since

        moved_aside, first_done = threading.Event(), threading.Event()
        other_errors = []

        def other_writer():
            try:
                publish_directory(replacing, final)
            except Exception as error:  # noqa: BLE001 - reported by the assertion below
                other_errors.append(error)

        other = threading.Thread(target=other_writer)
        real_hasher, real_rmtree = xxhash.xxh3_128, shutil.rmtree

        def hasher_letting_the_other_writer_in(*args):
            if threading.current_thread() is not other and other.ident is None:  # not started yet
                other.start()
                moved_aside.wait(timeout=1)  # never set while we hold the publish lock: the other waits for it
            return real_hasher(*args)

        def rmtree_after_moving_aside(path, *args, **kwargs):
            if threading.current_thread() is other and "-replaced." in Path(path).name:  # the damaged copy
                moved_aside.set()
                first_done.wait(timeout=10)  # hold the gap open until the first writer is done
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(xxhash, "xxh3_128", hasher_letting_the_other_writer_in)
        monkeypatch.setattr(shutil, "rmtree", rmtree_after_moving_aside)
        try:
            assert publish_directory(judging, final) == final
        finally:
            first_done.set()
            other.join(timeout=30)
    assert other_errors == []
    assert {name: (final / name).read_bytes() for name in files} == files and changed_files(final) == []


@pytest.mark.parametrize("publish_name", ["publish_directory", "replace_directory"])
def test_publishing_reaches_the_disk_before_the_rename_does(tmp_path, monkeypatch, publish_name):
    """Power lost after a publish must not leave the published name holding empty files: every
    file and folder is fsynced before the rename, and the parent (the new entry) after it."""
    import os

    from training_core import storage

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(storage.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                        real_fsync(fd))[1])
    monkeypatch.setattr(storage.os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    with storage.staging_directory(tmp_path) as staging:
        (staging / "train").mkdir()
        (staging / "train" / "part-0.parquet").write_bytes(b"rows")
        (staging / "config.json").write_text("{}")
        written = {str(staging), str(staging / "train"), str(staging / "train" / "part-0.parquet"),
                   str(staging / "config.json")}
        final = getattr(storage, publish_name)(staging, tmp_path / "published")
    renames = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert [events[i][1] for i in renames] == [str(final)]
    assert {path for kind, path in events[:renames[0]] if kind == "fsync"} == written
    assert ("fsync", str(tmp_path)) in events[renames[0]:]
    assert (final / "train" / "part-0.parquet").read_bytes() == b"rows"


@pytest.mark.parametrize("record_damage", ["deleted", "emptied", "not a mapping"])
def test_a_published_copy_whose_digest_record_is_gone_is_replaced_not_trusted(tmp_path, caplog, record_damage):
    from training_core.storage import FILE_DIGESTS, changed_files, directory_digest, publish_directory, staging_directory

    def publish() -> Path:
        with staging_directory(tmp_path) as staging:
            (staging / "part-0.parquet").write_bytes(b"rows")
            digest = directory_digest(staging, record_files=True)
            return publish_directory(staging, tmp_path / digest[:16])

    final = publish()
    record = final / FILE_DIGESTS
    if record_damage == "deleted":
        record.unlink()
    else:  # a crash left it empty, or someone edited it: unreadable is no record, never a traceback
        record.write_text("" if record_damage == "emptied" else "[1, 2]")
    (final / "part-0.parquet").unlink()  # damage nobody can see without the record
    with caplog.at_level("WARNING", logger="training_core.storage"):
        assert publish() == final
    assert (final / "part-0.parquet").read_bytes() == b"rows" and changed_files(final) == []
    assert f"{final} is not as published (no {FILE_DIGESTS} to verify it against): replacing it" in caplog.text
    if record_damage != "deleted":
        assert f"file digest record {record} is" in caplog.text


@pytest.mark.parametrize(("refusal", "published"), [(errno.EINVAL, True), (errno.EOPNOTSUPP, True), (errno.EIO, False)])
def test_a_filesystem_that_refuses_fsync_still_publishes_but_an_io_error_fails(tmp_path, monkeypatch, refusal, published):
    """Some FUSE and CIFS mounts answer fsync with EINVAL: publishing worked there before it synced."""
    from training_core import storage

    def refused(descriptor):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(storage.os, "fsync", refused)
    with storage.staging_directory(tmp_path) as staging:
        (staging / "part-0.parquet").write_bytes(b"rows")
        if published:
            final = storage.publish_directory(staging, tmp_path / "published")
            assert (final / "part-0.parquet").read_bytes() == b"rows"
        else:
            with pytest.raises(OSError, match=os.strerror(errno.EIO)):
                storage.publish_directory(staging, tmp_path / "published")
            assert not (tmp_path / "published").exists()

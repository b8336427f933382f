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


def test_publishing_over_a_damaged_copy_replaces_it(tmp_path):
    from training_core.storage import directory_digest, publish_directory, staging_directory

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
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


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

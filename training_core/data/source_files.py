"""Finding a source's data files: a local file or folder, or an fsspec URI (`s3://bucket/day/`,
`gs://…`, `file:///…`, `memory://…`); a folder is searched recursively. Hidden (`.`) and underscore
(`_SUCCESS`, `_temporary/`) names are skipped; any other file that is not a supported data file is
refused by name, so that no part of a day's export is left out without a word, and so is a folder
whose `_temporary/` holds files: an export still being written (beside `_SUCCESS`, a committed
export's leftovers or a later job appending: the message names both). On local disk (a
path or `file://`) links are followed, as the Parquet reader follows them: a folder or file linked
into the export is part of it, a folder reached twice through links is read once, and a link to
nothing is refused by name."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import fsspec
import fsspec.core
from fsspec.implementations.local import LocalFileSystem

from training_core.data.local_folders import (
    is_hidden_or_underscore,
    is_link_to_nothing,
    link_to_nothing,
    walk_local_files,
)
from training_core.errors import SourceDataError
from training_core.redaction import redact_uri

TEXT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv")  # each may also end in .gz
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, ".parquet")
READ_SUFFIXES = f"{'/'.join(SUPPORTED_SUFFIXES)} (the text ones also gzip-compressed, e.g. .jsonl.gz)"
SHOWN_REFUSED_FILES = 5
# Spark's and Hadoop's output committers write each task's files below `_temporary/` and move them out
# when the job commits, then write `_SUCCESS` beside it; an empty one may be left behind, and where cleanup
# is skipped or fails, one holding a failed or speculative task attempt's files.
UNCOMMITTED_EXPORT_FOLDER = "_temporary"
COMMITTED_EXPORT_MARKER = "_SUCCESS"
HTTP_REQUEST_TIMEOUT_S = 60.0  # RowGroupReader's and warm_cache's read_timeout_s default: one storage request


@dataclass(frozen=True)
class SourceFile:
    """One data file, read through `fs` (fsspec) at `path`; `location` is how messages and origins show
    it: the local path, or the URI with its scheme (`s3://bucket/day/a.jsonl`) and its credentials
    redacted (`http://alice:***@host/a.jsonl?sig=***`)."""

    location: str
    path: str
    fs: Any = field(repr=False, compare=False)

    def __str__(self) -> str:
        return self.location

    @property
    def suffix(self) -> str:
        """Lower case, a `.gz` kept with the suffix it compresses: 'A.JSONL.GZ' -> '.jsonl.gz'."""
        # An HTTP(S) file's path is its whole URL: a query (a presigned URL's signature) follows the name.
        name = urlsplit(self.path).path if "://" in self.path else self.path
        path = PurePosixPath(name.lower())
        return PurePosixPath(path.stem).suffix + ".gz" if path.suffix == ".gz" else path.suffix

    @property
    def format(self) -> str | None:
        """'jsonl', 'json', 'csv' or 'parquet'; None for a file that is not read."""
        suffix = self.suffix
        if suffix.endswith(".gz") and suffix[:-3] in TEXT_SUFFIXES:
            suffix = suffix[:-3]
        if suffix not in SUPPORTED_SUFFIXES:
            return None
        return "jsonl" if suffix == ".ndjson" else suffix[1:]


def redacted_cause(error: Exception) -> str:
    # An OSError says what it is ("[Errno 13] Permission denied"); a store's own types may not, and a
    # timeout says nothing at all (fsspec's FSTimeoutError, asyncio's TimeoutError print as "").
    # Either may quote the URL it was given, credentials included (fsspec's FileNotFoundError does).
    text, kind = str(error), type(error).__name__
    if isinstance(error, TimeoutError):  # an OSError too
        cause = f"timed out: {kind}: {text}" if text else f"timed out: {kind}"
    elif not text:
        cause = kind
    else:
        cause = text if isinstance(error, OSError) else f"{kind}: {text}"
    return redact_uri(cause)


def _http_options(reading: bool) -> dict[str, Any]:
    """fsspec options of an HTTP(S) source; aiohttp's default waits 300 s for a silent server. Listing: a
    request gets HTTP_REQUEST_TIMEOUT_S in all (the loader's storage request), a limit on the whole
    request because fsspec's `exists` takes a read timeout for "not found". Reading: the same limit on
    silence only, since a file of unknown size streams in one request that may rightly take longer."""
    import aiohttp  # fsspec's HTTP filesystem needs it; imported only for HTTP sources

    timeout = (aiohttp.ClientTimeout(total=None, sock_connect=HTTP_REQUEST_TIMEOUT_S, sock_read=HTTP_REQUEST_TIMEOUT_S)
               if reading else aiohttp.ClientTimeout(total=HTTP_REQUEST_TIMEOUT_S))
    return {"client_kwargs": {"timeout": timeout}}


def chainable_unless_credentials(error: Exception) -> Exception | None:
    """`error`, or None where its text or that of an error it chains quotes credentials: a traceback,
    and Dagster's event log, would show them (the message names its cause, redacted, by `redacted_cause`)."""
    chained: BaseException | None = error
    seen = set()
    while chained is not None and id(chained) not in seen:
        if redact_uri(str(chained)) != str(chained):
            return None
        seen.add(id(chained))
        chained = chained.__cause__ or chained.__context__
    return error


def _refuse_uncommitted_export(shown: str, files_in: dict[str, int], is_file: Callable[[str], bool]) -> None:
    """Refuse a source folder where `files_in` (the path of each `_temporary` folder relative to the
    source, with the number of files below it) is not empty: reading it would train on the files
    committed so far only. `_SUCCESS` beside a `_temporary` (`is_file` takes a path relative to the
    source) does not settle it: a committed job whose cleanup failed leaves attempt files there, but so
    does a later job appending to the folder, still writing; the message names both."""
    held = {folder: count for folder, count in files_in.items() if count}
    if not held:
        return
    root = shown.rstrip("/")
    committed = [folder for folder in held if is_file(str(PurePosixPath(folder).parent / COMMITTED_EXPORT_MARKER))]
    if writing := [folder for folder in held if folder not in committed]:
        raise SourceDataError(
            f"{'; '.join(f'{root}/{folder} holds {held[folder]} file(s)' for folder in writing)}: an export still "
            f"being written (its job moves them out of {UNCOMMITTED_EXPORT_FOLDER}/ when it commits), so {shown} holds "
            f"part of its records only. Wait for the export to commit, or remove {UNCOMMITTED_EXPORT_FOLDER} if the "
            "job writing it is gone"
        )
    raise SourceDataError(
        f"{'; '.join(f'{root}/{folder} holds {held[folder]} file(s)' for folder in committed)} beside "
        f"{COMMITTED_EXPORT_MARKER}: either a committed export's cleanup left them (remove "
        f"{UNCOMMITTED_EXPORT_FOLDER}), or a later job appending to {shown} is still writing them (wait for it to "
        "commit); read now, the day could train on part of its records"
    )


def _list_local(path: Path, shown_as: str) -> tuple[bool, list[tuple[str, SourceFile]]]:
    """(is a folder, [(path relative to `path`, file)] sorted); hidden and underscore names left out.
    Messages and origins show the files below `shown_as`, the source as the user wrote it."""
    if not path.exists():
        raise SourceDataError(f"source path {shown_as} does not exist")
    local = fsspec.filesystem("file")
    if path.is_file():
        return False, [(path.name, SourceFile(shown_as, str(path), local))]
    found = []
    def refuse(error: OSError) -> SourceDataError:
        return SourceDataError(f"{error.filename}: cannot be listed ({redacted_cause(error)})")

    def raise_refusal(error: OSError) -> None:
        raise refuse(error) from error

    uncommitted: dict[str, int] = {}
    def count_uncommitted(relative: str) -> None:
        if PurePosixPath(relative).name == UNCOMMITTED_EXPORT_FOLDER:
            uncommitted[relative] = sum(len(names) for _, _, names in os.walk(path / relative, onerror=raise_refusal))

    relatives = sorted(walk_local_files(path, refuse, count_uncommitted), key=lambda r: PurePosixPath(r).parts)
    _refuse_uncommitted_export(shown_as, uncommitted, lambda relative: (path / relative).is_file())
    for relative in relatives:
        file = path / relative
        shown = f"{shown_as.rstrip('/')}/{relative}"
        if is_link_to_nothing(file):
            raise SourceDataError(link_to_nothing(shown, file))
        if not file.is_file():
            raise SourceDataError(f"{shown}: not a regular file")
        found.append((relative, SourceFile(shown, str(file), local)))
    return True, found


def _list_uri(uri: str) -> tuple[bool, list[tuple[str, SourceFile]]]:
    """As `_list_local`, for an fsspec URI; names keep the URI as written, scheme included, its
    credentials redacted."""
    shown = redact_uri(uri)
    is_http = fsspec.core.split_protocol(uri)[0] in ("http", "https")
    try:
        fs, root = fsspec.core.url_to_fs(uri, **(_http_options(reading=False) if is_http else {}))
        reading_fs = fsspec.core.url_to_fs(uri, **_http_options(reading=True))[0] if is_http else fs
    except Exception as error:  # ImportError: s3fs/gcsfs not installed; ValueError: unknown protocol
        raise SourceDataError(f"source {shown}: cannot open its filesystem ({redacted_cause(error)})") from chainable_unless_credentials(error)
    if isinstance(fs, LocalFileSystem):  # file://: links are followed as for a plain path
        return _list_local(Path(root), uri)
    try:
        exists = fs.exists(root)
        is_file = exists and fs.isfile(root)
        found = fs.find(root) if exists and not is_file else []
    except Exception as error:  # a store's own types too: botocore's NoCredentialsError is no OSError
        cause = redacted_cause(error)
        if isinstance(error, TimeoutError) and is_http:
            cause += f": no answer within {HTTP_REQUEST_TIMEOUT_S:g} s; is the server up?"
        raise SourceDataError(f"source {shown}: cannot be listed ({cause})") from chainable_unless_credentials(error)
    if not exists:
        raise SourceDataError(f"source path {shown} does not exist")
    if is_file:
        return False, [(PurePosixPath(root).name, SourceFile(shown, root, reading_fs))]
    base = root.rstrip("/") + "/"
    relative = sorted((p[len(base):] for p in found if p.startswith(base) and len(p) > len(base)),
                      key=lambda r: PurePosixPath(r).parts)  # parts, as local Paths sort
    uncommitted: dict[str, int] = {}
    for r in relative:  # as locally: a _temporary folder that the reader would otherwise skip
        parts = PurePosixPath(r).parts
        skipped_at = next((i for i, part in enumerate(parts[:-1]) if is_hidden_or_underscore(part)), None)
        if skipped_at is not None and parts[skipped_at] == UNCOMMITTED_EXPORT_FOLDER:
            folder = "/".join(parts[:skipped_at + 1])
            uncommitted[folder] = uncommitted.get(folder, 0) + 1
    listed = set(relative)
    _refuse_uncommitted_export(shown, uncommitted, lambda r: r in listed)
    return True, [(r, SourceFile(f"{shown.rstrip('/')}/{r}", base + r, reading_fs))
                  for r in relative if not is_hidden_or_underscore(r)]


def list_source_files(source: str | Path) -> list[SourceFile]:
    """The data files at `source` (a file, or a folder searched recursively; a local path or an
    fsspec URI), sorted. Suffixes match in any case (`A.JSONL`); a file given directly must have
    one of them, and a folder may hold no other visible file."""
    text = os.fspath(source)
    if not text.strip():
        raise SourceDataError("source is empty; give a JSONL/CSV/Parquet file or a folder of them (a path or a URI)")
    # As in parquet_files: "://" marks a URI, whose path is the store's (never `~`-expanded).
    root = redact_uri(text) if "://" in text else str(Path(text).expanduser())  # as messages show it
    is_folder, found = _list_uri(text) if "://" in text else _list_local(Path(root), root)  # text: the real URI
    if not is_folder:
        file = found[0][1]
        if file.format is None:
            raise SourceDataError(f"{file}: unsupported file type {file.suffix or '(no suffix)'!r}; "
                                  f"expected one of {READ_SUFFIXES}")
        return [file]
    # Skipping a file silently would train on part of the export (a day's .jsonl.gz parts, say).
    if refused := [relative for relative, file in found if file.format is None]:
        shown = ", ".join(refused[:SHOWN_REFUSED_FILES])
        more = f" and {len(refused) - SHOWN_REFUSED_FILES} more" if len(refused) > SHOWN_REFUSED_FILES else ""
        raise SourceDataError(
            f"{root}: {len(refused)} file(s) that are not data files: {shown}{more}; "
            f"a source folder holds only {READ_SUFFIXES} files (hidden and _-prefixed names are skipped). "
            "Move the others out (or rename them to start with '_'), or point `source` at the data files"
        )
    if not found:
        raise SourceDataError(f"no {READ_SUFFIXES} files under {root}")
    return [file for _, file in found]

"""A source URI's credentials stay out of every message about it, on each path a source can fail
by (a folder refused for the files it holds, a Parquet file that cannot be read), and the query a
presigned URL carries changes nothing about how its file is read (a .jsonl.gz is still gzip)."""

from __future__ import annotations

import gzip
import io

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data.sources import iter_records, list_source_files
from training_core.errors import SourceDataError

from .test_credential_redaction import PASSWORD, SIGNATURE, _serving


def test_a_uri_folder_refused_for_the_files_it_holds_is_named_without_its_password():
    # memory:// takes everything after "://" as its path, so the folder's URI carries a password with
    # no server behind it; what is shown goes through the same redaction as any other scheme's.
    fs = fsspec.filesystem("memory")
    fs.pipe({f"/alice:{PASSWORD}@exports/day/a.jsonl": b'{"prompt": "a", "response": "b"}\n',
             f"/alice:{PASSWORD}@exports/day/notes.txt": b"x"})
    try:
        with pytest.raises(SourceDataError) as caught:
            list_source_files(f"memory://alice:{PASSWORD}@exports/day")
    finally:
        fs.rm(f"/alice:{PASSWORD}@exports", recursive=True)
    assert str(caught.value).startswith("memory://alice:***@exports/day: 1 file(s) that are not data files: notes.txt")
    assert PASSWORD not in str(caught.value)


def test_an_unreadable_parquet_file_over_http_is_named_without_its_password_or_signature():
    buffer = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["a"], "response": ["b"]}), buffer)
    with _serving({"/day.parquet": buffer.getvalue()}, PASSWORD, refuse_ranges=True) as base:  # reads answer 403
        with pytest.raises(SourceDataError) as caught:
            list(iter_records(f"{base}/day.parquet?sig={SIGNATURE}"))
    message = str(caught.value)
    assert "/day.parquet?sig=***: not a readable Parquet file (" in message
    assert SIGNATURE not in message and PASSWORD not in message


def test_a_presigned_gzip_url_is_read_as_gzip_by_the_suffix_of_its_path():
    body = gzip.compress(b'{"prompt": "a", "response": "b"}\n')
    with _serving({"/exports/day.jsonl.gz": body}) as base:
        url = f"{base}/exports/day.jsonl.gz?X-Amz-Credential=AKIAFAKE&X-Amz-Signature={SIGNATURE}"
        assert list(iter_records(url)) == [{"prompt": "a", "response": "b"}]

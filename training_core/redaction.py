"""Credentials kept out of what is shown: messages, logs, check descriptions, saved origins.

A source or tracking URI may carry them: a password in its userinfo (`http://alice:PW@host/…`,
`postgresql://user:PW@db/mlflow`) or a signature in its query (`?X-Amz-Signature=…`, `?sig=…`).
What is read or connected to is still the real URI; only what is shown is redacted.
"""

from __future__ import annotations

import re

REDACTED = "***"
# A URI is only what has a scheme and "://": a local path holding "?" or "@" is shown as it is. It ends
# at whitespace or a quote, so a URI inside a message (or its repr) is found there too.
# A "'" may sit in a password (RFC 3986 allows it unencoded): it is kept in the match, and one that
# closes a quoted URI is trailing punctuation.
_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"<>`]+")
_TRAILING_PUNCTUATION = ".,;:!?)]}'"  # the message's, after a URI ("… at 'http://h/x?sig=…': not found")
# Stores whose userinfo names a container, not a person: abfs://container@account.dfs.core.windows.net/…
_CONTAINER_USERINFO = ("abfs", "abfss", "az", "adl")
# Database URIs, read by SQLAlchemy: "user:" up to the next "@" is always userinfo, whatever follows ":".
_SQLALCHEMY_SCHEMES = ("postgresql", "mysql", "mariadb", "mssql", "oracle")


def redact_uri(text: str) -> str:
    """`text` with every URI in it redacted: the password of its userinfo becomes "***" (the user is
    kept, as SQLAlchemy shows it; userinfo without a password, a token, is "***" whole, except where
    it names an Azure container) and so does every query-parameter value (the names are kept; an
    item without "=" is all value). Text without "scheme://" is returned unchanged, as is a URI that
    carries neither (`s3://bucket/day/a.jsonl`)."""
    return _URI.sub(_redacted_match, text)


def _redacted_match(match: re.Match[str]) -> str:
    uri = match[0]
    kept = uri.rstrip(_TRAILING_PUNCTUATION)
    return _redacted(kept) + uri[len(kept):]


def _redacted(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    authority_end = _authority_end(scheme, rest)
    authority, tail = rest[:authority_end], rest[authority_end:]
    userinfo, at, host = authority.rpartition("@")  # rpartition: a raw "@" in a password stays in it
    if at and ":" in userinfo:
        authority = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{host}"
    elif at and scheme.lower() not in _CONTAINER_USERINFO:  # a token alone (https://ghp_…@host) is sent as a password
        authority = f"{REDACTED}@{host}"
    path, question, query = tail.partition("?")
    if question:
        query, hash_mark, fragment = query.partition("#")
        query = "&".join(map(_redacted_parameter, query.split("&"))) + hash_mark + fragment
    return f"{scheme}://{authority}{path}{question}{query}"


def _authority_end(scheme: str, rest: str) -> int:
    """Where the authority of `rest` (the URI after "scheme://") ends. By RFC 3986 that is the first "/",
    "?" or "#", but operators paste passwords holding them raw, and SQLAlchemy sends everything from
    "user:" to the next "@" as the password (`postgresql://mlflow:Zx8/k+Qw@db/mlflow`): so where the
    RFC's authority reads as "user:…" it runs on past the next "@" to the host's end. Outside a
    database URI, "host:<digits>" is a host and port (`http://minio:9000/exports/alice@example.com/…`)."""
    rfc_end = _first_delimiter(rest, 0)
    authority = rest[:rfc_end]
    at = rest.find("@", rfc_end)
    _, colon, after_colon = authority.partition(":")
    is_port = after_colon.isdigit() and scheme.lower().split("+")[0] not in _SQLALCHEMY_SCHEMES
    if "@" in authority or at < 0 or not colon or is_port or authority.startswith("["):
        return rfc_end  # userinfo already whole, none, or a host (with its port, or an IPv6 literal)
    return _first_delimiter(rest, at)


def _first_delimiter(rest: str, start: int) -> int:
    return min((i for i in (rest.find(d, start) for d in "/?#") if i >= 0), default=len(rest))


def _redacted_parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    if equals:
        return f"{name}={REDACTED}"
    return REDACTED if parameter else parameter

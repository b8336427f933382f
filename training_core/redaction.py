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
    authority_end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
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


def _redacted_parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    if equals:
        return f"{name}={REDACTED}"
    return REDACTED if parameter else parameter

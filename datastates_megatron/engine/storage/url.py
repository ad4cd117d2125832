"""Where a persistent tier lives: a directory, ``s3://bucket/prefix`` or ``msc://profile/path``.

Parsed once, into a :class:`StorageURL`; everything else takes that value.  A URL never carries
credentials (``s3://key:secret@bucket`` is refused, naming no part of it): they come from the
environment, the AWS config files or the MSC profile, as every AWS tool reads them.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["StorageURL", "parse_url", "is_object_url", "SCHEMES"]

SCHEMES = ("s3", "msc")
# S3's bucket naming rules (3-63 of lower-case letters, digits, dots, hyphens), and MSC's profile names
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PROFILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9!_.*'()=+,;@ -]+$")


@dataclasses.dataclass(frozen=True)
class StorageURL:
    """``scheme`` ``s3`` (``bucket`` a bucket) or ``msc`` (``bucket`` an MSC profile); ``prefix``
    the key prefix without leading or trailing ``/`` (``""``: the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        """The full object key of ``rel`` (relative to the prefix)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel


def is_object_url(location: str) -> bool:
    """Whether ``location`` names object storage (``s3://``, ``msc://``) rather than a path."""
    head, sep, _ = str(location).partition("://")
    return bool(sep) and head.lower() in SCHEMES


def parse_url(location: str) -> StorageURL:
    """Parse ``s3://bucket[/prefix]`` or ``msc://profile[/path]``; ``ValueError`` naming what is
    wrong (never echoing a part that could be a secret: ``user:secret@`` is refused unprinted)."""
    text = str(location)
    head, sep, rest = text.partition("://")
    scheme = head.lower()
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"{text!r}: not an object storage URL (s3://bucket/prefix or msc://profile/path)")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ValueError(
            f"{scheme}:// URL: its host part holds '@' or ':' (credentials or a port?); a URL names only "
            "the bucket (or MSC profile): credentials come from the environment or the profile"
        )
    if "?" in rest or "#" in rest:
        raise ValueError(f"{text!r}: a storage URL has no query or fragment")
    ok = _BUCKET.match(bucket) if scheme == "s3" else _PROFILE.match(bucket)
    if not ok:
        what = "an S3 bucket name" if scheme == "s3" else "an MSC profile name"
        raise ValueError(f"{text!r}: {bucket!r} is not {what}")
    parts = [p for p in prefix.split("/") if p]
    for p in parts:
        if p in (".", "..") or not _SEGMENT.match(p):
            raise ValueError(f"{text!r}: prefix segment {p!r} is not a plain name")
    return StorageURL(scheme, bucket, "/".join(parts))

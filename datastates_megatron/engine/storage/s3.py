"""S3 (and S3-compatible) storage through boto3: streamed multipart uploads checksummed end to end,
ranged GETs, conditional creates, bounded retries.

Uploads (:meth:`S3Storage.put_file`) are CRC32 multipart uploads with S3's ``COMPOSITE`` checksum
(what ``aws s3 cp`` sends, and what S3-compatible stores support most widely): each part is hashed
(zlib's CRC32, several GB/s) on the thread that sends it and sent with its checksum, which S3 checks
on receipt; the completion names every part's CRC32, and the object's checksum a ``HEAD`` then
reports (the CRC32 of the parts' CRC32s, :mod:`.crc`) is compared with ours -- so an object whose
stored bytes differ from the source is refused even by a store that skips the checks on receipt.
(A ``FULL_OBJECT`` checksum would add nothing we use -- a restore verifies our own XXH64 chunks --
and costs a store that recomputes it a second pass over the object at completion.)  Parts are sent ``concurrency`` at a time from slices of the
source buffer (a mapped rank file): memory in flight is ``concurrency * part_bytes``, never a copy
of the object.

The S3 client's own retries are off: :mod:`.retry` is the one bounded policy, and every request has
the stated deadline of :mod:`.timeouts` (connect and first byte in seconds; configurable).  Messages name the
object by URL and the error by its S3 code or class: never a credential, never the endpoint's
user-info (:func:`safe_text`).

Thread-safety: boto3 clients are thread-safe; the part pool is owned by the storage and shut down
by :meth:`S3Storage.close`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import threading
import zlib
from collections.abc import Iterator

from ..errors import CheckpointError
from .base import (
    ObjectChecksumError,
    ObjectExistsError,
    ObjectInfo,
    ObjectMissingError,
    ObjectStorageError,
    PutReceipt,
    Storage,
)
from .crc import composite_crc32, crc32_b64, crc32_from_b64, crc32_of_parts
from .retry import Retry
from .timeouts import ENV, Timeouts
from .url import StorageURL

__all__ = ["S3Storage", "safe_text", "MIN_PART_BYTES"]

log = logging.getLogger(__name__)
MIN_PART_BYTES = 5 << 20  # S3's smallest part (but the last)
_MAX_PARTS = 10_000
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "ConditionalRequestConflict",  # a concurrent conditional write on the same key: try again
}


def safe_text(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with the endpoint's user-info and every known credential value removed."""
    text = _USERINFO.sub("***@", str(text))
    for value in (*secrets, *(os.environ.get(k, "") for k in _CREDENTIAL_ENV)):
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _import_boto3():
    try:
        import boto3
        import botocore
    except ImportError as e:
        raise ObjectStorageError(
            "s3:// storage needs boto3, which is not installed: pip install 'datastates-megatron[s3]'"
        ) from e
    return boto3, botocore


class S3Storage(Storage):
    """Objects under ``url`` (``s3://bucket/prefix``).  ``endpoint_url``: an S3-compatible service
    (default: boto3's own resolution, which reads ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``);
    ``part_bytes``: the multipart part size (raised so that an object has at most 10,000 parts);
    ``concurrency``: parts of one object sent at once; ``connect_timeout_s``, ``read_timeout_s``,
    ``deadline_s``: :mod:`.timeouts` (``None``: the environment's, else the default); ``credentials``: ``boto3.session.Session``
    keyword arguments (default: the environment's, as every AWS tool reads them).  Thread-safe;
    :meth:`close` is idempotent."""

    scheme = "s3"

    def __init__(
        self,
        url: StorageURL,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_bytes: int = 32 << 20,
        concurrency: int = 8,
        retry: Retry | None = None,
        connect_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        deadline_s: float | None = None,
        credentials: dict | None = None,
        client=None,
    ) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be >= {MIN_PART_BYTES} (S3's smallest part), got {part_bytes}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._url = url
        self.bucket = url.bucket
        self._base = f"{url.prefix}/" if url.prefix else ""
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self.retry = retry or Retry()
        self.timeouts = Timeouts.from_env(connect_s=connect_timeout_s, read_s=read_timeout_s, deadline_s=deadline_s)
        boto3, botocore = _import_boto3()
        self._botocore = botocore
        if client is None:
            from botocore.config import Config

            config = Config(
                retries={"total_max_attempts": 1},  # :mod:`.retry` is the one policy
                max_pool_connections=concurrency + 4,
                connect_timeout=self.timeouts.connect_s,
                read_timeout=self.timeouts.read_s,
                request_checksum_calculation="when_required",  # we send our own CRC32s
                response_checksum_validation="when_required",
            )
            session = boto3.session.Session(**(credentials or {}))  # else the environment's, as every AWS tool
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        # credentials given here (an MSC profile's) are scrubbed from every message like the environment's
        self._secrets = tuple(str(v) for v in (credentials or {}).values() if v)
        self._client = client
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ names and errors
    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._base}{key}".rstrip("/") if key or self._base else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        if key.startswith("/") or any(p in (".", "..") for p in key.split("/")):
            raise ValueError(f"{key!r}: not a relative object key")
        return self._base + key

    def _code(self, e: BaseException) -> tuple[str, int]:
        if isinstance(e, self._botocore.exceptions.ClientError):
            err = e.response.get("Error", {})
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return str(err.get("Code", "")), int(status or 0)
        return "", 0

    def _transient(self, e: BaseException) -> bool:
        exc = self._botocore.exceptions
        if isinstance(e, (exc.ConnectionError, exc.HTTPClientError, exc.IncompleteReadError, ConnectionError)):
            return True
        if isinstance(e, exc.ResponseStreamingError if hasattr(exc, "ResponseStreamingError") else ()):
            return True
        code, status = self._code(e)
        return code in _TRANSIENT_CODES or status >= 500 or status == 429

    def _error(self, op: str, key: str):
        """The ``fail`` of :meth:`.retry.Retry.call`: the error raised for ``op`` on ``key``."""

        def fail(e: BaseException, tries: int) -> ObjectStorageError:
            code, status = self._code(e)
            where = self.url(key)
            what = f"S3 {code} (HTTP {status})" if code else f"{type(e).__name__}: {safe_text(e, self._secrets)}"
            cls = ObjectStorageError
            if status == 404 or code in ("NoSuchKey", "NotFound", "NoSuchUpload"):
                cls = ObjectMissingError
            elif status == 412 or code == "PreconditionFailed":
                cls = ObjectExistsError
            after = f" after {tries} tries" if tries > 1 else ""
            if isinstance(e, self._botocore.exceptions.ReadTimeoutError):
                what += f" ({self.timeouts.text()})"
            elif isinstance(e, self._botocore.exceptions.ConnectTimeoutError):
                what += f" (no connection within {self.timeouts.connect_s:g} s; {ENV['connect_s']} changes it)"
            return cls(f"{where}: {op} failed{after}: {what}", key=where)

        return fail

    def _call(self, op: str, key: str, fn):
        t = self.timeouts
        return self.retry.call(
            fn,
            transient=self._transient,
            what=f"{op} {self.url(key)}",
            fail=self._error(op, key),
            deadline_s=t.deadline_s,
            try_s=t.try_s,
        )

    def _parts_pool(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._closed:
                raise ObjectStorageError(f"{self.url()}: storage is closed")
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="dsm-s3-part")
            return self._pool

    # ------------------------------------------------------------------ writes
    def put_file(self, key: str, source, *, pace=None) -> PutReceipt:
        view = memoryview(source).cast("B") if not isinstance(source, memoryview) else source.cast("B")
        size = len(view)
        part = max(self.part_bytes, -(-size // _MAX_PARTS))
        full = self._key(key)
        c = self._client
        upload = self._call(
            "create multipart upload",
            key,
            # CRC32 without a checksum type: COMPOSITE, the default, exactly the request of ``aws s3 cp``
            lambda: c.create_multipart_upload(Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32"),
        )["UploadId"]
        try:
            parts = self._send_parts(key, full, upload, view, part, pace)
            done = self._call(
                "complete multipart upload",
                key,
                lambda: c.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload,
                    MultipartUpload={
                        "Parts": [
                            {"PartNumber": p["n"], "ETag": p["etag"], "ChecksumCRC32": crc32_b64(p["crc"])}
                            for p in parts
                        ]
                    },
                ),
            )
        except BaseException:
            self._abort(key, full, upload)
            raise
        crcs = [(p["crc"], p["size"]) for p in parts]
        whole = crc32_of_parts(crcs)
        etag = self._verify_stored(key, size, whole, composite_crc32([c for c, _ in crcs]), len(parts), done)
        return PutReceipt(key, size, whole, etag)

    def _send_parts(self, key: str, full: str, upload: str, view, part: int, pace) -> list[dict]:
        """Send ``view`` in parts of ``part`` bytes, at most ``concurrency`` at once (memory in
        flight bounded), in order of submission; the first failure cancels the rest and raises."""
        size = len(view)
        bounds = [(n + 1, lo, min(size, lo + part)) for n, lo in enumerate(range(0, max(size, 1), part))]
        pool = self._parts_pool()
        results: list[dict] = []
        pending: set[cf.Future] = set()
        try:
            for n, lo, hi in bounds:
                if len(pending) >= self.concurrency:
                    finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for f in finished:
                        results.append(f.result())
                        if pace is not None:
                            pace(results[-1]["size"])
                pending.add(pool.submit(self._send_part, key, full, upload, n, view[lo:hi]))
            for f in cf.as_completed(pending):
                results.append(f.result())
                if pace is not None:
                    pace(results[-1]["size"])
            pending = set()
        finally:
            for f in pending:
                f.cancel()
            cf.wait(pending)  # no part thread still reads ``view`` when this returns
        return sorted(results, key=lambda p: p["n"])

    def _send_part(self, key: str, full: str, upload: str, n: int, chunk) -> dict:
        body = bytes(chunk)  # one part's worth (http.client sends bytes in one call)
        crc = zlib.crc32(body)
        r = self._call(
            f"upload of part {n}",
            key,
            lambda: self._client.upload_part(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload,
                PartNumber=n,
                Body=body,
                ContentLength=len(body),
                ChecksumCRC32=crc32_b64(crc),
            ),
        )
        echoed = r.get("ChecksumCRC32")
        if echoed is not None and crc32_from_b64(echoed) != crc:
            raise ObjectChecksumError(
                f"{self.url(key)}: part {n}: the store holds CRC32 {echoed}, sent {crc32_b64(crc)}"
            )
        return {"n": n, "etag": r["ETag"], "crc": crc, "size": len(body)}

    def _abort(self, key: str, full: str, upload: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
        except Exception as e:  # noqa: BLE001 - the bucket's lifecycle rule removes it otherwise
            log.warning("%s: could not abort an unfinished upload (%s)", self.url(key), safe_text(e, self._secrets))

    def _verify_stored(self, key: str, size: int, whole: int, composite: int, n_parts: int, done: dict) -> str:
        """Compare what the store reports holding (``HEAD``: size and CRC32 checksum, composite of
        ``n_parts`` parts unless the store reports a full-object one) with what was sent; a mismatch
        removes the object (ours, never committed) and raises."""
        full = self._key(key)
        h = self._call(
            "head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
        )
        reported = h.get("ChecksumCRC32")
        expected = whole if h.get("ChecksumType") == "FULL_OBJECT" else composite
        count = reported.rpartition("-")[2] if reported is not None and "-" in reported else str(n_parts)
        problem = None
        if int(h.get("ContentLength", -1)) != size:
            problem = f"holds {h.get('ContentLength')} bytes, {size} were sent"
        elif reported is not None and (crc32_from_b64(reported) != expected or count != str(n_parts)):
            problem = f"holds CRC32 {reported}, the {n_parts} parts sent have {crc32_b64(expected)}"
        elif reported is None:
            log.debug("%s: the store reports no CRC32 checksum; relying on its checks on receipt", self.url(key))
        if problem is not None:
            try:
                self._client.delete_object(Bucket=self.bucket, Key=full)
            except Exception as e:  # noqa: BLE001 - never committed: start-up cleanup removes it
                log.warning("%s: could not remove the damaged upload (%s)", self.url(key), safe_text(e, self._secrets))
            raise ObjectChecksumError(f"{self.url(key)}: upload damaged in transit: the store {problem}")
        return str(h.get("ETag", done.get("ETag", "")))

    def put_bytes(self, key: str, data: bytes) -> PutReceipt:
        return self._put(key, data, "put")

    def create(self, key: str, data: bytes) -> PutReceipt:
        try:
            return self._put(key, data, "conditional create", IfNoneMatch="*")
        except ObjectExistsError:
            # a create whose answer was lost and then retried finds its own object: the same bytes
            info = self.head(key)
            if info is not None and info.size == len(data):
                try:
                    if self.read_capped(key, len(data), "object", info.size) == bytes(data):
                        return PutReceipt(key, len(data), zlib.crc32(data), info.etag)
                except CheckpointError:  # gone, or replaced since the HEAD: not ours
                    pass
            raise

    def replace_if(self, key: str, data: bytes, etag: str) -> PutReceipt:
        return self._put(key, data, "conditional replace", IfMatch=etag)

    def _put(self, key: str, data: bytes, op: str, **cond) -> PutReceipt:
        data = bytes(data)
        crc = zlib.crc32(data)
        full = self._key(key)
        r = self._call(
            op,
            key,
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=full, Body=data, ContentLength=len(data), ChecksumCRC32=crc32_b64(crc), **cond
            ),
        )
        return PutReceipt(key, len(data), crc, str(r.get("ETag", "")))

    # ------------------------------------------------------------------ reads
    def get(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        if stop is not None and stop <= start:
            return b""
        full = self._key(key)
        kw = {} if start == 0 and stop is None else {"Range": f"bytes={start}-{'' if stop is None else stop - 1}"}

        def fetch() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=full, **kw)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        data = self._call("get", key, fetch)
        if stop is not None and len(data) != stop - start:
            raise ObjectStorageError(
                f"{self.url(key)}: asked for bytes [{start}, {stop}), got {len(data)} bytes (object shorter?)",
                key=self.url(key),
            )
        return data

    def get_into(self, key: str, start: int, out) -> int:
        view = memoryview(out).cast("B")
        if not len(view):
            return 0
        full = self._key(key)

        def fetch() -> int:
            body = self._client.get_object(
                Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + len(view) - 1}"
            )["Body"]
            pos = 0
            try:
                while pos < len(view):
                    chunk = body.read(min(8 << 20, len(view) - pos))
                    if not chunk:
                        break
                    view[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
            finally:
                body.close()
            return pos

        return self._call("ranged get", key, fetch)

    def head(self, key: str) -> ObjectInfo | None:
        full = self._key(key)
        try:
            h = self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except ObjectMissingError:
            return None
        return ObjectInfo(key, int(h["ContentLength"]), str(h.get("ETag", "")))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = self._base + prefix
        token = None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": full, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", prefix, lambda kw=kw: self._client.list_objects_v2(**kw))
            for o in page.get("Contents", ()):
                yield ObjectInfo(o["Key"][len(self._base) :], int(o["Size"]), str(o.get("ETag", "")))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def list_dirs(self, prefix: str = "") -> list[str]:
        full = self._base + prefix
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": full, "Delimiter": "/", "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", prefix, lambda kw=kw: self._client.list_objects_v2(**kw))
            out += [p["Prefix"][len(full) :].rstrip("/") for p in page.get("CommonPrefixes", ())]
            if not page.get("IsTruncated"):
                return sorted(out)
            token = page["NextContinuationToken"]

    def delete(self, key: str, etag: str | None = None) -> None:
        full = self._key(key)
        kw = {"IfMatch": etag} if etag else {}
        try:
            self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full, **kw))
        except ObjectMissingError:
            if etag:
                raise
            return

    def abort_unfinished(self, prefix: str, keep) -> list[str]:
        """Abort the multipart uploads under ``prefix`` that were never completed (a job killed while
        uploading: invisible, but their parts are stored and billed) whose relative key ``keep(key)``
        accepts; the keys aborted.  Only the lock holder calls it, at start-up: no upload of a live
        writer can be among them."""
        aborted = []
        kw = {"Bucket": self.bucket, "Prefix": self._base + prefix}
        while True:
            page = self._call(
                "list unfinished uploads", prefix, lambda kw=dict(kw): self._client.list_multipart_uploads(**kw)
            )
            for u in page.get("Uploads", ()):
                rel = u["Key"][len(self._base) :]
                if keep(rel):
                    self._abort(rel, u["Key"], u["UploadId"])
                    aborted.append(rel)
            if not page.get("IsTruncated"):
                return aborted
            kw.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

"""A small HTTP proxy in front of the moto server, run as its own process by the object-storage
tests (``python -m tests.objstore.s3_proxy PORT UPSTREAM RULES``): it relays every request, except
that it plays two other parties a real bucket has.

* An access policy that refuses deletions: a ``DELETE`` of a key under one of ``refuse_delete``'s
  prefixes is answered ``403 AccessDenied`` (as S3 answers a policy's explicit deny), not relayed;
  ``refuse_write`` does the same to a ``PUT`` or ``POST`` (an upload, a multipart upload's start).
* Another client deleting objects while we list: once a listing whose ``prefix`` parameter equals
  ``vanish_after_list.prefix`` has been answered, the keys of ``vanish_after_list.delete`` are
  deleted on the server (by a client of its own) before the listing is answered (once).
* A network that damages data: the first ``UploadPart`` of a key under ``damage_part``'s prefix has
  one byte of its body flipped on the way (its checksum header relayed unchanged), once.

``RULES`` is a JSON file, read again for each request, so a test changes the rules as it goes."""

from __future__ import annotations

import http.client
import http.server
import json
import sys
import threading
import urllib.parse

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (a bucket policy of the test)</Message></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class _Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    rules_path: str
    other_client = None  # a boto3 client of the server itself, with the environment's credentials
    fired: set = set()
    lock = threading.Lock()

    def log_message(self, *a) -> None:  # quiet
        pass

    def _rules(self) -> dict:
        with open(self.rules_path, encoding="utf-8") as f:
            return json.load(f)

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        rules = self._rules()
        path, _, query = self.path.partition("?")
        key = urllib.parse.unquote(path.lstrip("/")).partition("/")[2]
        if self.command == "DELETE" and key and any(key.startswith(p) for p in rules.get("refuse_delete", ())):
            self._answer(403, {"Content-Type": "application/xml"}, _DENIED)
            return
        if self.command in ("PUT", "POST") and key and any(key.startswith(p) for p in rules.get("refuse_write", ())):
            self._answer(403, {"Content-Type": "application/xml"}, _DENIED)
            return
        damage = rules.get("damage_part")
        if damage and self.command == "PUT" and "partNumber=" in query and key.startswith(damage):
            with self.lock:
                fire = ("damage", damage) not in self.fired
                self.fired.add(("damage", damage))
            if fire and body:
                flipped = bytearray(body)
                flipped[len(body) // 2] ^= 0x01
                body = bytes(flipped)
        status, headers, data = self._forward(self.command, self.path, body, dict(self.headers))
        vanish = rules.get("vanish_after_list")
        params = urllib.parse.parse_qs(query)
        if vanish and "list-type" in params and params.get("prefix", [""])[0] == vanish["prefix"]:
            with self.lock:
                fire = vanish["prefix"] not in self.fired
                self.fired.add(vanish["prefix"])
            if fire:
                bucket = urllib.parse.unquote(path.lstrip("/")).partition("/")[0]
                for k in vanish["delete"]:
                    self.other_client.delete_object(Bucket=bucket, Key=k)
        self._answer(status, headers, data)

    def _forward(self, method: str, path: str, body: bytes, headers: dict):
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {k: v for k, v in headers.items() if k.lower() not in _HOP}
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, {k: v for k, v in r.getheaders() if k.lower() not in _HOP}, r.read()
        finally:
            conn.close()

    def _answer(self, status: int, headers: dict, data: bytes) -> None:
        self.send_response_only(status)
        length = str(len(data))
        for k, v in headers.items():
            if k.lower() == "content-length" and self.command == "HEAD":
                length = v  # a HEAD answers the object's length, with no body
            elif k.lower() not in ("content-length", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


def main(port: int, upstream: str, rules_path: str) -> None:
    u = urllib.parse.urlparse(upstream)
    _Proxy.upstream = (u.hostname, u.port)
    _Proxy.rules_path = rules_path
    import boto3

    _Proxy.other_client = boto3.client("s3", endpoint_url=upstream)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Proxy)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

"""The HTTP client under the SDK: one http.client connection per request (the standard
library only), JSON in and out, raw bodies streamed, and streaming answers (a command's ndjson
output, a file's bytes) handed back unread."""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.parse
from typing import Any, BinaryIO, Dict, Iterable, Iterator, Optional, Union

from .errors import DormantApiError, api_error

#: Where a daemon listens by default: ``dormant serve`` on this host.
DEFAULT_URL = "http://127.0.0.1:7420"

#: A raw request body: bytes, a binary file, or an iterable of byte chunks (sent chunked).
RawBody = Union[bytes, bytearray, memoryview, BinaryIO, Iterable[bytes]]

#: A line longer than this is refused (the daemon's longest is one 1 MiB output chunk, base64).
_MAX_LINE = 4 * 1024 * 1024


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return v if v else None


class Stream:
    """An answer being read: its body as bytes or as ndjson values. Close it to stop (for a
    foreground command's output, closing kills the command)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self._conn = conn
        self.response = resp

    def read(self, n: int = -1) -> bytes:
        return self.response.read(n) if n >= 0 else self.response.read()

    def lines(self) -> Iterator[Any]:
        """The JSON values of an ndjson body, one per line, until it ends."""
        while True:
            line = self.response.readline(_MAX_LINE + 1)
            if not line:
                return
            if len(line) > _MAX_LINE:
                raise api_error("DAEMON_UNREACHABLE", "ndjson line too long: not a dormant daemon")
            line = line.strip()
            if line:
                yield json.loads(line)

    def close(self) -> None:
        # Shut the socket first: a thread blocked reading this answer wakes up at once.
        try:
            if self._conn.sock is not None:
                self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._conn.close()


class Transport:
    """Where the daemon is and who calls: ``url`` (default ``DORMANT_URL``) and ``token``
    (default ``DORMANT_TOKEN``); ``request_timeout`` in seconds bounds each request (for a
    stream, the wait for its answer's head)."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ):
        self.url = (url or _env("DORMANT_URL") or DEFAULT_URL).rstrip("/")
        self.token = token or _env("DORMANT_TOKEN")
        self.request_timeout = request_timeout if request_timeout is not None else 300.0
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {self.url}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._base = parts.path.rstrip("/")

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def open(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        raw: Optional[RawBody] = None,
        timeout: Optional[float] = None,
    ) -> Stream:
        """Sends a request and returns its answer unread once the head has arrived; a failed
        answer raises the typed error."""
        headers: Dict[str, str] = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        body: Any = None
        chunked = False
        if raw is not None:
            headers["Content-Type"] = "application/octet-stream"
            if isinstance(raw, (bytes, bytearray, memoryview)):
                body = bytes(raw)
            else:
                body, chunked = raw, True
        elif json_body is not None:
            headers["Content-Type"] = "application/json"
            body = json.dumps(json_body).encode()
        wait = timeout if timeout is not None else self.request_timeout
        conn = self._connect(wait)
        try:
            conn.request(method, self._base + path, body=body, headers=headers, encode_chunked=chunked)
            resp = conn.getresponse()
        except socket.timeout as e:
            conn.close()
            raise api_error(
                "TIMEOUT", f"{method} {path}: no answer from {self.url} in {wait} s", 0,
                "raise the client's request_timeout, or check the daemon log",
            ) from e
        except OSError as e:
            conn.close()
            raise api_error(
                "DAEMON_UNREACHABLE", f"cannot reach dormant at {self.url}: {e}", 0,
                "start it with `dormant serve`, or set DORMANT_URL",
            ) from e
        if resp.status >= 300:
            text = resp.read()
            conn.close()
            raise self._error(resp.status, text, f"{method} {path}: HTTP {resp.status}")
        # The head is in: the body may take as long as its command does.
        if conn.sock is not None:
            conn.sock.settimeout(None)
        return Stream(conn, resp)

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        raw: Optional[RawBody] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """Sends a request and returns its parsed JSON (or text)."""
        s = self.open(method, path, json_body=json_body, raw=raw, timeout=timeout)
        try:
            data = s.read()
        finally:
            s.close()
        if "application/json" in (s.response.getheader("Content-Type") or "") and data:
            return json.loads(data)
        return data.decode("utf-8", "replace")

    @staticmethod
    def _error(status: int, text: bytes, fallback: str) -> DormantApiError:
        try:
            err = json.loads(text).get("error") or {}
        except (ValueError, AttributeError):
            err = {}
        return api_error(err.get("code") or f"HTTP_{status}", err.get("message") or fallback, status, err.get("hint"))


def quote(s: str) -> str:
    """A path segment (an id or a name)."""
    return urllib.parse.quote(s, safe="")


def query(**params: Any) -> str:
    """A query string from the parameters that are not None (lists repeat the key)."""
    pairs = []
    for k, v in params.items():
        if v is None:
            continue
        for one in v if isinstance(v, (list, tuple)) else [v]:
            pairs.append((k, "true" if one is True else "false" if one is False else str(one)))
    return ("?" + urllib.parse.urlencode(pairs)) if pairs else ""

"""Files inside a sandbox, shaped like E2B's ``sandbox.files``, over the plain HTTP file
routes: bytes travel as raw bodies, streamed both ways, so any size works. Paths are inside the
sandbox (absolute, or from its working directory); its agent resolves them, so ``..`` and
symlinks cannot leave it."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Union

from ._http import Stream, Transport, query, quote
from .errors import NotFoundError

#: What ``write`` accepts: text, bytes, a binary file object, or an iterable of byte chunks.
WriteData = Union[str, bytes, bytearray, BinaryIO, Any]


@dataclass
class EntryInfo:
    """A file or folder; ``type`` is ``file``, ``dir``, ``symlink`` or ``other``."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    modified_time_ms: int
    symlink_target: Optional[str] = None

    @classmethod
    def from_api(cls, d: Dict[str, Any]) -> "EntryInfo":
        return cls(
            name=d["name"], path=d["path"], type=d["type"], size=d.get("size", 0), mode=d.get("mode", 0),
            modified_time_ms=d.get("mtimeMs", 0), symlink_target=d.get("symlinkTarget"),
        )


@dataclass
class WriteInfo:
    name: str
    path: str
    size: int
    type: str = "file"


@dataclass
class FilesystemEvent:
    """A change under a watched folder; ``name`` is relative to it (as in E2B)."""

    name: str
    path: str
    type: str
    is_dir: bool


@dataclass
class WatchHandle:
    """A running ``watch_dir``: events go to its callback and are also kept for
    :meth:`get_new_events` (E2B's polling form)."""

    _stream: Stream
    _events: List[FilesystemEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get_new_events(self) -> List[FilesystemEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    #: Why the watch ended by itself (the daemon closed it, the connection broke), else None.
    error: Optional[BaseException] = None
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True
        self._stream.close()


def _base(p: str) -> str:
    return p.rstrip("/").rsplit("/", 1)[-1]


class Files:
    """``sandbox.files``."""

    def __init__(self, transport: Transport, sandbox_id: str):
        self._t = transport
        self._id = sandbox_id

    def _path(self, rest: str = "", **params: Any) -> str:
        return f"/v1/sandboxes/{quote(self._id)}/files{rest}{query(**params)}"

    def read(self, path: str, format: str = "text") -> Union[str, bytes, Iterator[bytes]]:
        """A file's content: ``text`` (UTF-8), ``bytes``, or ``stream`` (an iterator of chunks,
        for big files)."""
        s = self._t.open("GET", self._path(path=path))
        if format == "stream":
            return self._chunks(s)
        try:
            data = s.read()
        finally:
            s.close()
        return data if format == "bytes" else data.decode("utf-8")

    @staticmethod
    def _chunks(s: Stream) -> Iterator[bytes]:
        try:
            while True:
                chunk = s.read(256 * 1024)
                if not chunk:
                    return
                yield chunk
        finally:
            s.close()

    def write(
        self, path_or_files: Union[str, List[Dict[str, Any]]], data: Optional[WriteData] = None, mode: Optional[int] = None
    ) -> Union[WriteInfo, List[WriteInfo]]:
        """Writes a file (parent folders made; an existing file replaced whole). The list form,
        ``write([{"path": p, "data": d}, ...])``, writes several."""
        if not isinstance(path_or_files, str):
            return [self._write_one(f["path"], f["data"], None) for f in path_or_files]
        if data is None:
            raise ValueError("write(path, data): data is missing")
        return self._write_one(path_or_files, data, mode)

    def _write_one(self, path: str, data: WriteData, mode: Optional[int]) -> WriteInfo:
        raw = data.encode() if isinstance(data, str) else data
        r = self._t.request(
            "PUT", self._path(path=path, mode=None if mode is None else format(mode, "03o")), raw=raw
        )
        return WriteInfo(name=_base(r["path"]), path=r["path"], size=r["size"])

    def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        """The entries of a folder, ``depth`` levels down (at most 16)."""
        r = self._t.request("GET", self._path("/list", path=path, depth=depth))
        return [EntryInfo.from_api(e) for e in r["entries"]]

    def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_api(self._t.request("GET", self._path("/stat", path=path)))

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
            return True
        except NotFoundError as e:
            if e.code == "FILE_NOT_FOUND":
                return False
            raise

    def make_dir(self, path: str) -> bool:
        """Makes a folder and its parents; False when it was already there."""
        return bool(self._t.request("POST", self._path("/mkdir"), {"path": path})["created"])

    def remove(self, path: str) -> None:
        """Removes a file, or a folder with everything in it."""
        self._t.request("POST", self._path("/remove"), {"path": path})

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        """Moves a file or folder; returns what is at the new path."""
        self._t.request("POST", self._path("/rename"), {"from": old_path, "to": new_path})
        return self.get_info(new_path)

    def watch_dir(
        self,
        path: str,
        on_event: Optional[Callable[[FilesystemEvent], None]] = None,
        recursive: bool = False,
    ) -> WatchHandle:
        """Watches a folder until ``stop()``; events go to ``on_event`` (on a thread of its own)
        and to ``get_new_events()``."""
        s = self._t.open("GET", self._path("/watch", path=path, recursive=True if recursive else None))
        handle = WatchHandle(s)
        root = path.rstrip("/")

        def pump() -> None:
            try:
                for e in s.lines():
                    p = e["path"]
                    name = p[len(root) + 1 :] if p.startswith(root + "/") else _base(p)
                    ev = FilesystemEvent(name=name, path=p, type=e["type"], is_dir=bool(e.get("isDir")))
                    with handle._lock:
                        handle._events.append(ev)
                    if on_event:
                        on_event(ev)
            except Exception:  # noqa: BLE001
                # Stopped: the socket was shut under the reader (http.client may then fail in
                # odd ways). Otherwise the daemon ended the watch; either way it is over.
                handle.error = None if handle.stopped else sys.exc_info()[1]
            finally:
                s.close()

        threading.Thread(target=pump, name="dormant-watch", daemon=True).start()
        return handle

"""``AsyncSandbox``: the same surface as :class:`~dormant_sdk.Sandbox` for asyncio programs.

It runs the synchronous client on worker threads (``asyncio.to_thread``): the standard library
has no asynchronous HTTP client, and a blocking call on a thread keeps streaming simple (one
thread per output stream, as in the sync SDK). Callbacks may be plain functions or coroutine
functions; both run on the event loop, in order, and output waits for them.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Dict, List, Optional, Union

from .commands import CommandHandle, CommandResult, ProcessInfo
from .files import EntryInfo, FilesystemEvent, WatchHandle, WriteInfo
from .sandbox import PtySize, Sandbox, SandboxInfo, SandboxMetrics, SandboxQuery


def _on_loop(cb: Optional[Callable[[Any], Any]], loop: asyncio.AbstractEventLoop) -> Optional[Callable[[Any], None]]:
    """A callback the worker thread calls, which runs ``cb`` on the loop and waits for it."""
    if cb is None:
        return None

    async def call(data: Any) -> None:
        r = cb(data)
        if inspect.isawaitable(r):
            await r

    return lambda data: asyncio.run_coroutine_threadsafe(call(data), loop).result()


class AsyncCommandHandle:
    """A background command (see :class:`~dormant_sdk.commands.CommandHandle`)."""

    def __init__(self, handle: CommandHandle):
        self._h = handle
        self.pid = handle.pid

    @property
    def stdout(self) -> str:
        return self._h.stdout

    @property
    def stderr(self) -> str:
        return self._h.stderr

    @property
    def exit_code(self) -> Optional[int]:
        return self._h.exit_code

    async def wait(self) -> CommandResult:
        return await asyncio.to_thread(self._h.wait)

    async def kill(self) -> bool:
        return await asyncio.to_thread(self._h.kill)

    async def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        await asyncio.to_thread(self._h.send_stdin, data, eof)

    async def disconnect(self) -> None:
        self._h.disconnect()


class AsyncCommands:
    def __init__(self, sync: Any):
        self._s = sync

    async def run(
        self, cmd: str, background: bool = False, on_stdout: Any = None, on_stderr: Any = None, **kw: Any
    ) -> Union[CommandResult, AsyncCommandHandle]:
        loop = asyncio.get_running_loop()
        r = await asyncio.to_thread(
            self._s.run, cmd, background=background, on_stdout=_on_loop(on_stdout, loop),
            on_stderr=_on_loop(on_stderr, loop), on_pty=_on_loop(kw.pop("on_pty", None), loop), **kw,
        )
        return AsyncCommandHandle(r) if isinstance(r, CommandHandle) else r

    async def connect(self, pid: int, on_stdout: Any = None, on_stderr: Any = None) -> AsyncCommandHandle:
        loop = asyncio.get_running_loop()
        h = await asyncio.to_thread(
            self._s.connect, pid, on_stdout=_on_loop(on_stdout, loop), on_stderr=_on_loop(on_stderr, loop)
        )
        return AsyncCommandHandle(h)

    async def list(self) -> List[ProcessInfo]:
        return await asyncio.to_thread(self._s.list)

    async def kill(self, pid: int, signal: str = "SIGKILL") -> bool:
        return await asyncio.to_thread(self._s.kill, pid, signal)

    async def send_stdin(self, pid: int, data: Union[str, bytes], eof: bool = False) -> None:
        await asyncio.to_thread(self._s.send_stdin, pid, data, eof)


class AsyncFiles:
    def __init__(self, sync: Any):
        self._s = sync

    async def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        if format == "stream":
            raise ValueError("AsyncSandbox.files.read: use format 'text' or 'bytes'")
        return await asyncio.to_thread(self._s.read, path, format)

    async def write(self, path_or_files: Any, data: Any = None, mode: Optional[int] = None) -> Any:
        return await asyncio.to_thread(self._s.write, path_or_files, data, mode)

    async def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        return await asyncio.to_thread(self._s.list, path, depth)

    async def get_info(self, path: str) -> EntryInfo:
        return await asyncio.to_thread(self._s.get_info, path)

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(self._s.exists, path)

    async def make_dir(self, path: str) -> bool:
        return await asyncio.to_thread(self._s.make_dir, path)

    async def remove(self, path: str) -> None:
        await asyncio.to_thread(self._s.remove, path)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return await asyncio.to_thread(self._s.rename, old_path, new_path)

    async def watch_dir(
        self, path: str, on_event: Optional[Callable[[FilesystemEvent], Any]] = None, recursive: bool = False
    ) -> WatchHandle:
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self._s.watch_dir, path, _on_loop(on_event, loop), recursive)


class AsyncPty:
    def __init__(self, sync: Any):
        self._s = sync

    async def create(self, size: PtySize, on_data: Any = None, **kw: Any) -> AsyncCommandHandle:
        loop = asyncio.get_running_loop()
        return AsyncCommandHandle(await asyncio.to_thread(self._s.create, size, _on_loop(on_data, loop), **kw))

    async def send_input(self, pid: int, data: bytes) -> None:
        await asyncio.to_thread(self._s.send_input, pid, data)

    async def resize(self, pid: int, size: PtySize) -> None:
        await asyncio.to_thread(self._s.resize, pid, size)

    async def kill(self, pid: int) -> bool:
        return await asyncio.to_thread(self._s.kill, pid)


class AsyncSandbox:
    """:class:`~dormant_sdk.Sandbox` for asyncio: ``await AsyncSandbox.create(...)``, then the
    same methods, awaited."""

    def __init__(self, sync: Sandbox):
        self._s = sync
        self.sandbox_id = sync.sandbox_id
        self.commands = AsyncCommands(sync.commands)
        self.files = AsyncFiles(sync.files)
        self.pty = AsyncPty(sync.pty)

    @property
    def id(self) -> str:
        return self.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        return self._s.info

    @classmethod
    async def create(cls, *args: Any, **kw: Any) -> "AsyncSandbox":
        return cls(await asyncio.to_thread(Sandbox.create, *args, **kw))

    @classmethod
    async def connect(cls, sandbox_id: str, **kw: Any) -> "AsyncSandbox":
        return cls(await asyncio.to_thread(Sandbox.connect, sandbox_id, **kw))

    @staticmethod
    async def list(
        query: Union[SandboxQuery, Dict[str, Any], None] = None, limit: Optional[int] = None, **conn: Any
    ) -> List[SandboxInfo]:
        return await asyncio.to_thread(Sandbox.list, query, limit, **conn)

    async def get_info(self) -> SandboxInfo:
        return await asyncio.to_thread(self._s.get_info)

    async def is_running(self) -> bool:
        return await asyncio.to_thread(self._s.is_running)

    async def set_timeout(self, timeout: float) -> SandboxInfo:
        return await asyncio.to_thread(self._s.set_timeout, timeout)

    async def set_labels(self, labels: Dict[str, Optional[str]]) -> SandboxInfo:
        return await asyncio.to_thread(self._s.set_labels, labels)

    async def get_metrics(self, since_ms: Optional[int] = None) -> List[SandboxMetrics]:
        return await asyncio.to_thread(self._s.get_metrics, since_ms)

    async def pause(self) -> SandboxInfo:
        return await asyncio.to_thread(self._s.pause)

    async def hibernate(self) -> SandboxInfo:
        return await asyncio.to_thread(self._s.hibernate)

    async def resume(self) -> SandboxInfo:
        return await asyncio.to_thread(self._s.resume)

    async def archive(self) -> SandboxInfo:
        return await asyncio.to_thread(self._s.archive)

    async def fork(self, name: Optional[str] = None) -> "AsyncSandbox":
        return AsyncSandbox(await asyncio.to_thread(self._s.fork, name))

    async def kill(self) -> bool:
        return await asyncio.to_thread(self._s.kill)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()


__all__ = ["AsyncSandbox", "AsyncCommandHandle", "WriteInfo"]

"""Commands inside a sandbox, shaped like E2B's ``sandbox.commands``: ``run`` streams output
as it comes (the ndjson route ``POST /v1/sandboxes/{id}/commands``), a background command gives
a :class:`CommandHandle` to wait on, feed, kill or leave, and ``connect`` follows a command
started earlier (its output replayed from the start, then followed). A command's id is its
``pid`` inside the sandbox, as in E2B. Times are seconds, as in E2B's Python SDK."""

from __future__ import annotations

import base64
import codecs
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

from ._http import Stream, Transport, quote
from .errors import DormantApiError, api_error

#: A callback for output; ``str`` for stdout/stderr, ``bytes`` for a PTY's output.
OutputHandler = Callable[[Any], None]


@dataclass
class CommandResult:
    """What a finished command did; ``exit_code`` is -1 when a signal ended it (``error`` says
    which)."""

    stdout: str
    stderr: str
    exit_code: int
    error: Optional[str] = None


class CommandExitException(DormantApiError):
    """A command ended with a non-zero exit code, a signal or its timeout (E2B's
    ``CommandExitException``); it carries the whole result."""

    def __init__(self, result: CommandResult, signal: Optional[str] = None, timed_out: bool = False):
        message = result.error or f"command exited with code {result.exit_code}"
        if result.stderr and not result.error:
            message += f": {result.stderr[-500:]}"
        super().__init__("COMMAND_EXIT", message, 0)
        self.stdout = result.stdout
        self.stderr = result.stderr
        self.exit_code = result.exit_code
        self.error = result.error
        self.signal = signal
        self.timed_out = timed_out


#: The TypeScript SDK's name for the same error.
CommandExitError = CommandExitException


@dataclass
class ProcessInfo:
    """A command the sandbox's agent knows (running, or ended in the last 10 minutes)."""

    pid: int
    args: List[str]
    cwd: str
    tag: str
    pty: bool
    running: bool
    exit_code: Optional[int]
    signal: Optional[str]
    started_at: int
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def cmd(self) -> str:
        return self.args[0] if self.args else ""

    @classmethod
    def from_api(cls, d: Dict[str, Any]) -> "ProcessInfo":
        return cls(
            pid=d["pid"], args=d.get("args", []), cwd=d.get("cwd", ""), tag=d.get("tag", ""),
            pty=d.get("pty", False), running=d.get("running", False), exit_code=d.get("exitCode"),
            signal=d.get("signal"), started_at=d.get("startedAt", 0), raw=d,
        )


def _ms(seconds: Optional[float]) -> int:
    return 0 if not seconds else int(seconds * 1000)


def _bytes(data: Union[str, bytes]) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class CommandHandle:
    """A command followed over one output stream. Output accumulates in ``stdout`` and
    ``stderr`` (and goes to the callbacks) until it ends or :meth:`disconnect` is called. A
    background handle reads on its own thread; callbacks run there."""

    def __init__(
        self,
        commands: "Commands",
        pid: int,
        stream: Stream,
        events: Iterator[Any],
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_pty: Optional[OutputHandler] = None,
    ):
        self.pid = pid
        self._commands = commands
        self._stream = stream
        self._events = events
        self._on_stdout, self._on_stderr, self._on_pty = on_stdout, on_stderr, on_pty
        self._out: List[str] = []
        self._err: List[str] = []
        self._out_dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._err_dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._end: Optional[Dict[str, Any]] = None
        self._failure: Optional[BaseException] = None
        self._disconnected = False
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._pump, name=f"dormant-cmd-{self.pid}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for ev in self._events:
                kind = ev.get("type")
                if kind in ("stdout", "stderr"):
                    data = base64.b64decode(ev["data"])
                    if kind == "stdout":
                        text = self._out_dec.decode(data)
                        self._out.append(text)
                        if self._on_pty:
                            self._on_pty(data)
                        if self._on_stdout and text:
                            self._on_stdout(text)
                    else:
                        text = self._err_dec.decode(data)
                        self._err.append(text)
                        if self._on_stderr and text:
                            self._on_stderr(text)
                elif kind == "end":
                    self._end = ev
                    return
                elif kind == "error":
                    raise api_error(ev.get("code", "INTERNAL"), ev.get("message", "command failed"))
            raise api_error("DAEMON_UNREACHABLE", f"the output stream of command {self.pid} ended before it")
        except BaseException as e:  # noqa: BLE001 - kept for wait(), which raises it
            self._failure = e
        finally:
            self._stream.close()
            self._done.set()

    @property
    def stdout(self) -> str:
        """Standard output so far."""
        return "".join(self._out)

    @property
    def stderr(self) -> str:
        """Standard error so far."""
        return "".join(self._err)

    @property
    def exit_code(self) -> Optional[int]:
        """The exit code once it ended, else None."""
        if self._end is None:
            return None
        code = self._end.get("exitCode")
        return -1 if code is None else code

    @property
    def error(self) -> Optional[str]:
        if self._end is None:
            return None
        if self._end.get("timedOut"):
            return f"timed out after {self._end.get('durationMs')} ms"
        return f"killed by {self._end['signal']}" if self._end.get("signal") else None

    def wait(
        self,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_pty: Optional[OutputHandler] = None,
    ) -> CommandResult:
        """Waits for the end; raises :class:`CommandExitException` on a non-zero exit, a signal
        or a timeout. Callbacks given here replace the handle's for output still to come."""
        self._on_stdout = on_stdout or self._on_stdout
        self._on_stderr = on_stderr or self._on_stderr
        self._on_pty = on_pty or self._on_pty
        if self._thread is None:
            self._pump()
        else:
            self._done.wait()
        if self._failure is not None:
            if self._disconnected:
                raise api_error("DAEMON_UNREACHABLE", f"disconnected from command {self.pid}") from self._failure
            raise self._failure
        assert self._end is not None
        result = CommandResult(self.stdout, self.stderr, self.exit_code or 0, self.error)
        if result.exit_code != 0 or self._end.get("signal"):
            raise CommandExitException(result, self._end.get("signal"), bool(self._end.get("timedOut")))
        return result

    def kill(self) -> bool:
        """Sends SIGKILL; True if it was running."""
        return self._commands.kill(self.pid)

    def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> None:
        """Writes to its standard input (started with ``stdin=True``)."""
        self._commands.send_stdin(self.pid, data, eof=eof)

    def disconnect(self) -> None:
        """Stops following the output; the command keeps running (``connect`` follows it again)."""
        self._disconnected = True
        self._stream.close()


class Commands:
    """``sandbox.commands``."""

    def __init__(self, transport: Transport, sandbox_id: str):
        self._t = transport
        self._id = sandbox_id

    def _path(self, rest: str = "") -> str:
        return f"/v1/sandboxes/{quote(self._id)}/commands{rest}"

    def run(
        self,
        cmd: str,
        background: bool = False,
        envs: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        stdin: Union[bool, str, bytes, None] = None,
        timeout: Optional[float] = 60,
        tag: Optional[str] = None,
        pty: Optional[Dict[str, int]] = None,
        on_pty: Optional[OutputHandler] = None,
        request_timeout: Optional[float] = None,
    ) -> Union[CommandResult, CommandHandle]:
        """Runs ``cmd`` through ``/bin/sh -c``. Foreground: returns its result when it ends
        (callbacks run on this thread) and raises :class:`CommandExitException` on a non-zero
        exit. ``background=True``: returns a :class:`CommandHandle` at once. ``timeout`` in
        seconds kills it (0 or None: never). ``stdin=True`` keeps standard input open for
        ``send_stdin``; bytes or text are written to it and then it is closed."""
        data = None if stdin is None or isinstance(stdin, bool) else _bytes(stdin)
        body: Dict[str, Any] = {"cmd": cmd, "timeoutMs": _ms(timeout)}
        if cwd is not None:
            body["cwd"] = cwd
        if envs:
            body["envs"] = envs
        if stdin not in (None, False):
            body["stdin"] = True
        if tag is not None:
            body["tag"] = tag
        if pty is not None:
            body["pty"] = pty
        if background:
            info = self._t.request("POST", self._path(), {**body, "background": True}, timeout=request_timeout)
            if data is not None:
                self.send_stdin(info["pid"], data, eof=True)
            return self.connect(info["pid"], on_stdout=on_stdout, on_stderr=on_stderr, on_pty=on_pty)
        handle = self._follow("POST", self._path(), body, on_stdout, on_stderr, on_pty, request_timeout)
        try:
            if data is not None:
                self.send_stdin(handle.pid, data, eof=True)
            return handle.wait()
        finally:
            handle._stream.close()

    def connect(
        self,
        pid: int,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        on_pty: Optional[OutputHandler] = None,
    ) -> CommandHandle:
        """Follows a command started earlier: its output from the start, then as it comes."""
        h = self._follow("GET", self._path(f"/{pid}/output?from=0"), None, on_stdout, on_stderr, on_pty, None)
        h._start_thread()
        return h

    def _follow(self, method, path, body, on_stdout, on_stderr, on_pty, request_timeout) -> CommandHandle:
        stream = self._t.open(method, path, json_body=body, timeout=request_timeout)
        events = stream.lines()
        try:
            first = next(events, None)
            if first is None or first.get("type") not in ("start", "error"):
                raise api_error("DAEMON_UNREACHABLE", f"{method} {path}: no start line")
            if first["type"] == "error":
                raise api_error(first.get("code", "INTERNAL"), first.get("message", "command failed"))
        except BaseException:
            stream.close()
            raise
        return CommandHandle(self, int(first["pid"]), stream, events, on_stdout, on_stderr, on_pty)

    def list(self) -> List[ProcessInfo]:
        """The commands the agent knows: running ones, and ones ended in the last 10 minutes."""
        return [ProcessInfo.from_api(c) for c in self._t.request("GET", self._path())["commands"]]

    def kill(self, pid: int, signal: str = "SIGKILL") -> bool:
        """Sends a signal (default SIGKILL); False when the command had already ended."""
        return bool(self._t.request("POST", self._path(f"/{pid}/kill"), {"signal": signal})["killed"])

    def send_stdin(self, pid: int, data: Union[str, bytes], eof: bool = False) -> None:
        """Writes bytes or text to a command's standard input; ``eof=True`` closes it after."""
        self._t.request("POST", self._path(f"/{pid}/stdin" + ("?eof=true" if eof else "")), raw=_bytes(data))

    def resize(self, pid: int, cols: int, rows: int) -> None:
        """Changes a PTY command's size."""
        self._t.request("POST", self._path(f"/{pid}/resize"), {"cols": cols, "rows": rows})

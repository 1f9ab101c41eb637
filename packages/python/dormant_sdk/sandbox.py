"""Sandboxes as objects, shaped like E2B's Python SDK: ``Sandbox.create()``,
``Sandbox.connect(id)``, ``Sandbox.list()``, the lifecycle on the instance, and the toolbox
(``sandbox.commands``, ``sandbox.files``, ``sandbox.pty``). Times are seconds, as in E2B's
Python SDK; sizes are bytes.

Where dormant differs from E2B: a sandbox is not killed when its time is up, it falls asleep
(hibernates: processes and memory kept in the vault) and any later call wakes it. So E2B's
``timeout`` / ``set_timeout(seconds)`` here set how long the sandbox may stay idle before it
hibernates; ``lifetime`` is the hard end, and ``kill()`` deletes it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from ._http import Transport, query, quote
from .commands import CommandHandle, Commands, OutputHandler
from .errors import NotFoundError
from .files import Files

#: What a sandbox runs when neither a command nor an image's own is given: it idles, waiting.
_IDLE_COMMAND = ["sleep", "infinity"]


class SandboxInfo(dict):
    """A sandbox as the API describes it (a dict of its JSON), with attribute access in
    snake_case (``info.state``, ``info.memory_bytes``) and E2B's names ``sandbox_id`` and
    ``metadata`` (the labels)."""

    def __getattr__(self, name: str) -> Any:
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
        if camel in self:
            return self[camel]
        raise AttributeError(name)

    @property
    def sandbox_id(self) -> str:
        return self["id"]

    @property
    def metadata(self) -> Dict[str, str]:
        return self.get("labels") or {}


@dataclass
class SandboxQuery:
    """What ``Sandbox.list`` selects: labels (E2B's ``metadata``) all carried, and a state or
    several."""

    metadata: Optional[Dict[str, str]] = None
    labels: Optional[Dict[str, str]] = None
    state: Union[str, List[str], None] = None


@dataclass
class PtySize:
    rows: int
    cols: int


@dataclass
class SandboxMetrics:
    """One sample of the meter, with E2B's field names."""

    timestamp_ms: int
    cpu_used_pct: float
    mem_used: int
    disk_used: int


class Pty:
    """``sandbox.pty``: a shell on a new pseudo-terminal, as a background command whose output
    arrives as raw bytes; keys go in through the stdin route (plain HTTP)."""

    def __init__(self, commands: Commands):
        self._commands = commands

    def create(
        self,
        size: PtySize,
        on_data: Optional[OutputHandler] = None,
        cwd: Optional[str] = None,
        envs: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = 60,
    ) -> CommandHandle:
        """Starts ``/bin/sh -i`` on a terminal of ``size``; ``on_data`` gets its output bytes
        (on the handle's thread). ``timeout`` seconds kills it (0: never)."""
        h = self._commands.run(
            "exec /bin/sh -i", background=True, cwd=cwd, envs={"TERM": "xterm-256color", **(envs or {})},
            timeout=timeout, tag="pty", pty={"cols": size.cols, "rows": size.rows}, on_pty=on_data,
        )
        assert isinstance(h, CommandHandle)
        return h

    def send_input(self, pid: int, data: bytes) -> None:
        """Types into the terminal (raw bytes: ``b"\\x03"`` is Ctrl-C)."""
        self._commands.send_stdin(pid, data)

    def resize(self, pid: int, size: PtySize) -> None:
        self._commands.resize(pid, size.cols, size.rows)

    def kill(self, pid: int) -> bool:
        return self._commands.kill(pid)


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return v if v else None


def _ms(seconds: Optional[float]) -> Optional[int]:
    return None if seconds is None else int(seconds * 1000)


class _ClassOrInstance:
    """A method callable on the class (``Sandbox.kill(id)``) and on an instance
    (``sandbox.kill()``), as E2B's SDK has them."""

    def __init__(self, on_instance: str, on_class: str):
        self._on_instance, self._on_class = on_instance, on_class

    def __get__(self, obj: Any, owner: Any) -> Any:
        return getattr(obj, self._on_instance) if obj is not None else getattr(owner, self._on_class)


class Sandbox:
    """One sandbox. Get one from :meth:`create`, :meth:`connect` or :meth:`fork`. Connection:
    ``url``/``token`` (or E2B's ``api_key``), defaults ``DORMANT_URL`` and ``DORMANT_TOKEN``."""

    def __init__(self, transport: Transport, info: Dict[str, Any]):
        self._t = transport
        self._info = SandboxInfo(info)
        self.sandbox_id: str = info["id"]
        self.commands = Commands(transport, self.sandbox_id)
        self.files = Files(transport, self.sandbox_id)
        self.pty = Pty(self.commands)

    @property
    def id(self) -> str:
        return self.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        """What the daemon said last."""
        return self._info

    @property
    def state(self) -> str:
        return self._info["state"]

    @staticmethod
    def _transport(url=None, token=None, api_key=None, request_timeout=None) -> Transport:
        return Transport(url=url, token=token or api_key, request_timeout=request_timeout)

    @classmethod
    def create(
        cls,
        template: Optional[str] = None,
        timeout: Optional[float] = None,
        metadata: Optional[Dict[str, str]] = None,
        envs: Optional[Dict[str, str]] = None,
        *,
        labels: Optional[Dict[str, str]] = None,
        rootfs: Optional[str] = None,
        image: Optional[str] = None,
        command: Optional[List[str]] = None,
        name: Optional[str] = None,
        ports: Optional[List[Any]] = None,
        memory: Union[int, str, None] = None,
        cpus: Optional[float] = None,
        lifetime: Optional[float] = None,
        url: Optional[str] = None,
        token: Optional[str] = None,
        api_key: Optional[str] = None,
        request_timeout: Optional[float] = None,
        from_template: Optional[str] = None,
    ) -> "Sandbox":
        """Starts a sandbox and returns when it runs. ``from_template`` names a dormant
        template (``dormant template ls``): memory, processes and files start as the template's,
        and no rootfs, image or command is filled in. ``template`` is an OCI image layout on
        the daemon's machine (``DIR`` or ``DIR:TAG``), as ``image``; with neither an image nor
        a ``rootfs``, ``DORMANT_IMAGE`` or ``DORMANT_ROOTFS`` names one (E2B's default template).
        ``timeout`` seconds: hibernate after this long idle (not a kill); ``lifetime`` seconds:
        delete after this long."""
        t = cls._transport(url, token, api_key, request_timeout)
        image = image or template or (None if rootfs or from_template else _env("DORMANT_IMAGE"))
        rootfs = rootfs or (None if image or from_template else _env("DORMANT_ROOTFS"))
        body: Dict[str, Any] = {}
        for k, v in (
            ("name", name), ("rootfs", rootfs), ("image", image), ("ports", ports), ("memory", memory),
            ("cpus", cpus), ("idle", _ms(timeout)), ("lifetime", _ms(lifetime)),
        ):
            if v is not None:
                body[k] = v
        body["command"] = command if command is not None else (None if image or from_template else _IDLE_COMMAND)
        if body["command"] is None:
            del body["command"]
        if envs:
            body["env"] = envs
        if metadata or labels:
            body["labels"] = {**(metadata or {}), **(labels or {})}
        if from_template is not None:
            body["template"] = from_template
        return cls(t, t.request("POST", "/v1/sandboxes", body))

    @classmethod
    def connect(cls, sandbox_id: str, resume: bool = True, **conn: Any) -> "Sandbox":
        """An existing sandbox by id or name; a sleeping one is resumed first unless
        ``resume=False``."""
        t = cls._transport(**conn)
        info = t.request("GET", f"/v1/sandboxes/{quote(sandbox_id)}")
        if resume and info["state"] in ("paused", "hibernated", "archived"):
            info = t.request("POST", f"/v1/sandboxes/{quote(info['id'])}/resume")
        return cls(t, info)

    @classmethod
    def list(
        cls, query: Union[SandboxQuery, Dict[str, Any], None] = None, limit: Optional[int] = None, **conn: Any
    ) -> List[SandboxInfo]:
        """The token's sandboxes, oldest first, filtered on the daemon by labels and state;
        pages are followed up to ``limit``."""
        t = cls._transport(**conn)
        q = query if isinstance(query, SandboxQuery) else SandboxQuery(**(query or {}))
        labels = {**(q.metadata or {}), **(q.labels or {})}
        states = [q.state] if isinstance(q.state, str) else list(q.state or [])
        out: List[SandboxInfo] = []
        cursor: Optional[str] = None
        while True:
            page_limit = None if limit is None else min(100, limit - len(out))
            r = t.request("GET", "/v1/sandboxes" + _query(labels, states, page_limit, cursor))
            out.extend(SandboxInfo(s) for s in r["sandboxes"])
            cursor = r.get("nextCursor")
            if not cursor or (limit is not None and len(out) >= limit):
                return out if limit is None else out[:limit]

    @classmethod
    def _kill_by_id(cls, sandbox_id: str, **conn: Any) -> bool:
        return _kill(cls._transport(**conn), sandbox_id)

    def _op(self, op: str, body: Any = None) -> SandboxInfo:
        self._info = SandboxInfo(self._t.request("POST", f"/v1/sandboxes/{quote(self.sandbox_id)}/{op}", body))
        return self._info

    def get_info(self) -> SandboxInfo:
        """Asks the daemon for the current state."""
        self._info = SandboxInfo(self._t.request("GET", f"/v1/sandboxes/{quote(self.sandbox_id)}"))
        return self._info

    def is_running(self) -> bool:
        return self.get_info()["state"] == "running"

    def set_timeout(self, timeout: float) -> SandboxInfo:
        """E2B's ``set_timeout``: here the idle time (seconds) after which the sandbox
        hibernates; it is put to sleep, not killed, and the next call wakes it."""
        return self._patch({"idle": _ms(timeout)})

    def set_labels(self, labels: Dict[str, Optional[str]]) -> SandboxInfo:
        """Adds, changes (a string) or removes (None) labels."""
        return self._patch({"labels": labels})

    def _patch(self, body: Dict[str, Any]) -> SandboxInfo:
        self._info = SandboxInfo(self._t.request("PATCH", f"/v1/sandboxes/{quote(self.sandbox_id)}", body))
        return self._info

    def get_metrics(self, since_ms: Optional[int] = None) -> List[SandboxMetrics]:
        """CPU, memory and disk over time (oldest first)."""
        r = self._t.request("GET", f"/v1/sandboxes/{quote(self.sandbox_id)}/metrics" + query(since=since_ms))
        return [
            SandboxMetrics(s["at"], s["cpuPercent"], s["memoryBytes"], s["diskBytes"]) for s in r["samples"]
        ]

    def pause(self) -> SandboxInfo:
        """Freezes every process; memory stays held."""
        return self._op("pause")

    def hibernate(self) -> SandboxInfo:
        """Checkpoints processes and memory into the vault and frees the memory."""
        return self._op("hibernate")

    def resume(self) -> SandboxInfo:
        return self._op("resume")

    def archive(self) -> SandboxInfo:
        """Keeps only the filesystem."""
        return self._op("archive")

    def keepalive(self, for_seconds: Optional[float] = None) -> SandboxInfo:
        return self._op("keepalive", {} if for_seconds is None else {"for": _ms(for_seconds)})

    def fork(self, name: Optional[str] = None) -> "Sandbox":
        """A new sandbox restored from this one's latest checkpoint, with a copy of its files."""
        info = self._t.request(
            "POST", f"/v1/sandboxes/{quote(self.sandbox_id)}/fork", {} if name is None else {"name": name}
        )
        return Sandbox(self._t, info)

    def _kill(self) -> bool:
        return _kill(self._t, self.sandbox_id)

    #: Deletes the sandbox and its data, checkpoints included; False when it was already gone.
    #: Also ``Sandbox.kill(sandbox_id)`` on the class, as in E2B.
    kill = _ClassOrInstance("_kill", "_kill_by_id")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _kill(t: Transport, sandbox_id: str) -> bool:
    """Deletes a sandbox; False when there was none. The daemon's delete is idempotent (a gone
    sandbox answers as a deleted one), so whether there was one is asked first."""
    try:
        t.request("GET", f"/v1/sandboxes/{quote(sandbox_id)}")
    except NotFoundError:
        return False
    t.request("DELETE", f"/v1/sandboxes/{quote(sandbox_id)}")
    return True


def _query(labels: Dict[str, str], states: List[str], limit: Optional[int], cursor: Optional[str]) -> str:
    return query(label=[f"{k}={v}" for k, v in labels.items()] or None, state=states or None, limit=limit,
                 cursor=cursor)

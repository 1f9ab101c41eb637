"""dormant's Python SDK: sandboxes that fall asleep when idle and wake with their processes and
memory intact, shaped like E2B's SDK. Standard library only.

    from dormant_sdk import Sandbox
    sbx = Sandbox.create(metadata={"user": "ada"})       # DORMANT_URL, DORMANT_TOKEN, DORMANT_ROOTFS
    print(sbx.commands.run("echo hi", on_stdout=print).stdout)
    sbx.files.write("/tmp/a.txt", "hello")
    sbx.hibernate()                                       # memory in the vault; any call wakes it
    sbx.kill()
"""

from ._http import DEFAULT_URL, Transport
from .aio import AsyncCommandHandle, AsyncSandbox
from .commands import CommandExitError, CommandExitException, CommandHandle, CommandResult, ProcessInfo
from .errors import (
    ERROR_FAMILIES,
    AuthenticationError,
    ConflictError,
    DaemonConnectionError,
    DormantApiError,
    ForbiddenError,
    InvalidArgumentError,
    NotFoundError,
    RequestTimeoutError,
    SandboxOperationError,
    VaultError,
)
from .files import EntryInfo, FilesystemEvent, WatchHandle, WriteInfo
from .sandbox import PtySize, Sandbox, SandboxInfo, SandboxMetrics, SandboxQuery

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_URL", "Transport", "Sandbox", "AsyncSandbox", "AsyncCommandHandle", "SandboxInfo", "SandboxQuery",
    "SandboxMetrics", "PtySize", "CommandHandle", "CommandResult", "CommandExitException", "CommandExitError",
    "ProcessInfo", "EntryInfo", "FilesystemEvent", "WatchHandle", "WriteInfo", "ERROR_FAMILIES",
    "DormantApiError", "AuthenticationError", "ForbiddenError", "NotFoundError", "InvalidArgumentError",
    "ConflictError", "SandboxOperationError", "VaultError", "DaemonConnectionError", "RequestTimeoutError",
]

"""Typed errors of the Python SDK.

Every error the dormant API answers carries a stable ``code`` (``SANDBOX_NOT_FOUND``,
``FILE_NOT_FOUND``, ...). Each code belongs to a family in the daemon's error table
(src/domain/errors.ts); the SDK maps each family to a class, so callers can
``except NotFoundError`` and still read ``e.code``, ``e.status`` and ``e.hint``.

The code-to-family table below is kept by hand (the package is pure Python and ships alone);
the repository's test (src/sdk/python.test.ts) fails when the daemon's table has a code this one
lacks or classes differently.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


class DormantApiError(Exception):
    """Any error the API answered (or the daemon could not be reached), with its stable code."""

    def __init__(self, code: str, message: str, status: int = 0, hint: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        #: The HTTP status the API answered; 0 when no answer came.
        self.status = status
        #: What to do about it.
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class AuthenticationError(DormantApiError):
    """The token is missing, unknown or revoked (401)."""


class ForbiddenError(DormantApiError):
    """The token may not do this (403)."""


class NotFoundError(DormantApiError):
    """No such sandbox, checkpoint, file or command for this token's tenant (404)."""


class InvalidArgumentError(DormantApiError):
    """The request was invalid (400); the message names the field."""


class ConflictError(DormantApiError):
    """Not possible in the current state (409); the hint says what to do first."""


class SandboxOperationError(DormantApiError):
    """A lifecycle operation failed on the node (hibernate, resume, CRIU, runtime)."""


class VaultError(DormantApiError):
    """The checkpoint vault refused or failed."""


class DaemonConnectionError(DormantApiError):
    """The daemon could not be reached (``DAEMON_UNREACHABLE``): not running, or a wrong URL."""


class RequestTimeoutError(DormantApiError):
    """A request took longer than the client's ``request_timeout`` (``TIMEOUT``)."""


#: Codes the client makes itself (status 0: no answer came), besides the API's.
CLIENT_ERROR_CODES = ("DAEMON_UNREACHABLE", "TIMEOUT")

#: The family of each code of the API's error table.
ERROR_FAMILIES: Dict[str, str] = {
    "INVALID_ARGUMENT": "invalid",
    "BAD_REQUEST": "invalid",
    "METHOD_NOT_ALLOWED": "invalid",
    "REQUEST_TOO_LARGE": "too-large",
    "REQUEST_HEAD_TOO_LARGE": "too-large",
    "UNSUPPORTED_MEDIA_TYPE": "invalid",
    "REQUEST_TIMEOUT": "timeout",
    "NOT_FOUND": "not-found",
    "UNAUTHORIZED": "unauthenticated",
    "FORBIDDEN": "forbidden",
    "HOST_PATH_FORBIDDEN": "forbidden",
    "TOKEN_NOT_FOUND": "not-found",
    "LAST_ADMIN_TOKEN": "conflict",
    "SANDBOX_NOT_FOUND": "not-found",
    "SANDBOX_NAME_TAKEN": "conflict",
    "ILLEGAL_TRANSITION": "conflict",
    "NO_CHECKPOINT": "conflict",
    "HIBERNATE_FAILED": "operation",
    "RESUME_FAILED": "operation",
    "RESTORE_INCOMPATIBLE": "conflict",
    "CHECKPOINT_DAMAGED": "conflict",
    "FILESYSTEM_PACK_FAILED": "operation",
    "FILESYSTEM_UNPACK_FAILED": "operation",
    "IMAGE_INVALID": "invalid",
    "IMAGE_REQUIRED": "unprocessable",
    "IMAGE_MISMATCH": "unprocessable",
    "EGRESS_POLICY_INVALID": "invalid",
    "EGRESS_HOST_UNRESOLVABLE": "unprocessable",
    "SANDBOX_NAME_AMBIGUOUS": "conflict",
    "NO_RESTORE_LOG": "not-found",
    "IMAGE_REF_INVALID": "invalid",
    "IMAGE_NOT_FOUND": "not-found",
    "IMAGE_ARCH_MISMATCH": "unprocessable",
    "IMAGE_DIGEST_MISMATCH": "unavailable",
    "IMAGE_TOO_LARGE": "too-large",
    "IMAGE_PULL_TIMEOUT": "timeout",
    "REGISTRY_UNAVAILABLE": "unavailable",
    "REGISTRY_UNAUTHORIZED": "forbidden",
    "REGISTRY_CREDENTIALS_NOT_FOUND": "not-found",
    "VAULT_FORMAT_NEWER": "vault",
    "TEMPLATE_NOT_FOUND": "not-found",
    "TEMPLATE_NAME_TAKEN": "conflict",
    "TEMPLATE_DAMAGED": "conflict",
    "TEMPLATES_UNAVAILABLE": "unavailable",
    "TEMPLATE_NOT_READY": "unprocessable",
    "GPU_UNAVAILABLE": "conflict",
    "GPU_NO_DRIVER": "conflict",
    "GPU_CHECKPOINT_UNSUPPORTED": "conflict",
    "GPU_CHECKPOINT_FAILED": "operation",
    "GPU_FORK_UNSUPPORTED": "conflict",
    "GPU_KEEP_RUNNING": "conflict",
    "GPU_FILESYSTEM_ONLY": "conflict",
    "GPU_RESTORE_FAILED": "operation",
    "CHECKPOINT_NOT_FOUND": "not-found",
    "CHECKPOINT_EXISTS": "conflict",
    "CHECKPOINT_FILESYSTEM_ONLY": "conflict",
    "CHECKPOINT_READS_DISABLED": "unavailable",
    "CHECKPOINT_ARCHIVE_INVALID": "unprocessable",
    "CHECKPOINT_ARCHIVE_TOO_LARGE": "too-large",
    "CHECKPOINT_HAS_SECRETS": "conflict",
    "CHECKPOINT_OUTSIDE_PROFILE": "unprocessable",
    "CRIU_IMAGE_MALFORMED": "unprocessable",
    "STATE_UNAVAILABLE": "unavailable",
    "STATE_IN_USE": "conflict",
    "NODE_NOT_FOUND": "not-found",
    "NODE_UNAVAILABLE": "unavailable",
    "SANDBOX_BUSY": "conflict",
    "VAULT_CORRUPT": "vault",
    "VAULT_KEY_MISSING": "vault",
    "VAULT_NOT_FOUND": "not-found",
    "VAULT_IO": "vault",
    "VAULT_KEY_WRONG": "forbidden",
    "VAULT_BUSY": "vault",
    "TENANT_KEY_DESTROYED": "vault",
    "SANDBOX_KEY_DESTROYED": "vault",
    "COMMAND_FAILED": "internal",
    "COMMAND_TIMEOUT": "timeout",
    "COMMAND_ABORTED": "internal",
    "COMMAND_NOT_FOUND": "internal",
    "CRIU_NOT_FOUND": "operation",
    "CRIU_TOO_OLD": "operation",
    "CRIU_DUMP_FAILED": "operation",
    "CRIU_RESTORE_FAILED": "operation",
    "RUNTIME_SANDBOX_EXISTS": "conflict",
    "RUNTIME_SANDBOX_NOT_FOUND": "not-found",
    "RUNTIME_INVALID_STATE": "conflict",
    "RUNTIME_CREATE_FAILED": "operation",
    "RUNTIME_EXEC_FAILED": "operation",
    "RUNTIME_CHECKPOINT_FAILED": "operation",
    "RUNTIME_RESTORE_FAILED": "operation",
    "RUNTIME_NETWORK_FAILED": "operation",
    "RUNTIME_NO_ADDRESS": "unavailable",
    "RUNTIME_ROOTFS_FAILED": "operation",
    "RUNTIME_LOG_FAILED": "operation",
    "INTERNAL": "internal",
    "WAKE_TIMEOUT": "unavailable",
    "WAKE_FAILED": "unavailable",
    "PROXY_BUSY": "unavailable",
    "PROXY_NO_ROUTE": "not-found",
    "PROXY_AMBIGUOUS": "conflict",
    "PROXY_UPSTREAM": "unavailable",
    "PROXY_DISABLED": "unavailable",
    # The toolbox (commands and files inside a sandbox).
    "FILE_NOT_FOUND": "not-found",
    "FILE_EXISTS": "conflict",
    "NOT_A_DIRECTORY": "invalid",
    "IS_A_DIRECTORY": "invalid",
    "DIRECTORY_NOT_EMPTY": "conflict",
    "FILE_PERMISSION_DENIED": "forbidden",
    "PROCESS_NOT_FOUND": "not-found",
    "TOOLBOX_UNAVAILABLE": "unavailable",
}

_CLASS_OF_FAMILY: Dict[str, Type[DormantApiError]] = {
    "invalid": InvalidArgumentError,
    "unauthenticated": AuthenticationError,
    "forbidden": ForbiddenError,
    "not-found": NotFoundError,
    "conflict": ConflictError,
    "operation": SandboxOperationError,
    "vault": VaultError,
}

_CLASS_OF_STATUS: Dict[int, Type[DormantApiError]] = {
    400: InvalidArgumentError,
    401: AuthenticationError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
}


def error_class_for(code: str, status: int) -> Type[DormantApiError]:
    """The class for a code: its family's; a code this SDK does not know (a newer daemon's)
    is classed by its HTTP status; otherwise DormantApiError."""
    if code == "DAEMON_UNREACHABLE":
        return DaemonConnectionError
    if code == "TIMEOUT":
        return RequestTimeoutError
    family = ERROR_FAMILIES.get(code)
    if family is not None:
        return _CLASS_OF_FAMILY.get(family, DormantApiError)
    return _CLASS_OF_STATUS.get(status, DormantApiError)


def api_error(code: str, message: str, status: int = 0, hint: Optional[str] = None) -> DormantApiError:
    """The typed error for an API answer."""
    return error_class_for(code, status)(code, message, status, hint)

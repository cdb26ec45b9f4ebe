"""Credentials out of what is printed, logged or written down: URLs with `user:password@`
and secret query parameters.

Addresses a user gives (a tracking URI, a Kubeflow host) may carry credentials; what ShardRL
writes down (configs, run.json, logs, MLflow params and tags, messages) gets them masked by
`redacted`, and the config refuses them outright where it would be copied (`has_userinfo`).
"""

from __future__ import annotations

import re
import sys
import threading
import traceback

_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.-])(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)"
    r"(?:[^\s/?#@:]*:[^\s\"'<>,]{0,1024}|[^/\s]*|[^\s/?#@:]*:\S{0,1024})@")
"""A URL's `user:password@`: after a user and a colon, up to the last `@` of the address (a
password may hold `@` and `/`, as database drivers read `postgresql://u:ab/cd@db/x`), else a
user alone up to the last `@` before the path. An address whose path holds an `@` after a
port (`http://host:8080/a@b`, `"uri":"http://h:1/","owner":"ops@corp"`) is masked too: the
safe way to be wrong. Within 1,024 characters, so the search stays linear on long log lines."""
_SECRET_QUERY = re.compile(
    r"(?i)(?P<name>[?&](?:access_token|token|password|passwd|secret|api_key|apikey|key|sig|"
    r"signature|x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&\s#]+")


def redacted(text: str) -> str:
    """`text` with the user and password of every URL in it, and the values of secret query
    parameters (`?token=...`), replaced by `***`."""
    return _SECRET_QUERY.sub(r"\g<name>***", _USERINFO.sub(r"\g<scheme>***@", text))


def has_userinfo(url: str) -> bool:
    """Whether `url` names a user or password (`scheme://user:password@host`)."""
    return bool(_USERINFO.match(url.strip()))


def without_userinfo(url: str) -> str:
    """`url` without its `user:password@` (a link needs no credentials)."""
    return _USERINFO.sub(r"\g<scheme>", url, count=1)


def _print_redacted(kind, value, tb, header: str = "") -> None:
    sys.stderr.write(header + redacted("".join(traceback.format_exception(kind, value, tb))))
    sys.stderr.flush()


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as the default hook: a thread's exit is no error
        return
    name = args.thread.name if args.thread is not None else "unknown"
    _print_redacted(args.exc_type, args.exc_value, args.exc_traceback,
                    f"Exception in thread {name}:\n")


def redact_tracebacks() -> None:
    """Print the tracebacks of uncaught exceptions, in the main thread and in the others,
    with credentials masked: a library's error may quote an address with `user:password@`
    in it (an MLflow server that refuses the request, say)."""
    sys.excepthook = _print_redacted
    threading.excepthook = _thread_hook

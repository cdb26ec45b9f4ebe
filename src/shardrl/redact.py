"""Credentials out of what is printed, logged or written down: URLs with `user:password@`
and secret query parameters.

Addresses a user gives (a tracking URI, a Kubeflow host) may carry credentials; what ShardRL
writes down (configs, run.json, logs, MLflow params and tags, messages) gets them masked by
`redacted`, and the config refuses them outright where it would be copied (`has_userinfo`).
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
"""A URL's `user:password@`, up to its last `@` before the path (a password may hold `@`)."""
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

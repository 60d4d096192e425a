"""The Hugging Face Hub client every Speedtronic Hub call goes through: DiLoCo's Hub bus
(diloco/bus/hub.py) and `speedtronic export --push-to-hub` (interop/hub_upload.py).

What it adds to huggingface_hub's HfApi:
- a timeout on every request, enforced in the transport (most HfApi calls pass `timeout=None`);
- retries with exponential backoff for transient failures only (5xx, 408, 409, 412, 429 with its
  Retry-After, timeouts, refused connections); permission errors fail at once;
- failures as one-line BusError / TransientBusError / PermissionDenied messages that name the repo
  and never contain the token (it is remembered as a secret and scrubbed);
- the token from the caller, then HF_TOKEN, then the stored `hf auth login`; the endpoint from the
  caller, then HF_ENDPOINT, then the public Hub.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from speedtronic.errors import BusError, PermissionDenied, TransientBusError
from speedtronic.secrets import env_token, remember_secret, scrub, stored_login_token

logger = logging.getLogger("speedtronic.diloco")
T = TypeVar("T")
PUBLIC_HUB = "https://huggingface.co"
_TIMEOUT_INSTALLED: list[float] = []


class NotFound(BusError):
    pass


def install_timeout(seconds: float) -> None:
    """Give every huggingface_hub request a timeout. Most of its calls pass `timeout=None`, which
    overrides a client default, so the limit is enforced in the transport instead."""
    if _TIMEOUT_INSTALLED and _TIMEOUT_INSTALLED[0] == seconds:
        return
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import hf_request_event_hook

    class DeadlineTransport(httpx2.HTTPTransport):
        def handle_request(self, request: Any) -> Any:
            given = request.extensions.get("timeout") or {}
            limits = {
                k: given.get(k) if given.get(k) is not None else seconds
                for k in ("connect", "read", "write", "pool")
            }
            request.extensions = {**request.extensions, "timeout": limits}
            return super().handle_request(request)

    def factory() -> Any:
        return httpx2.Client(
            transport=DeadlineTransport(),
            event_hooks={"request": [hf_request_event_hook]},
            follow_redirects=True,
            timeout=seconds,
        )

    set_client_factory(factory)
    _TIMEOUT_INSTALLED[:] = [seconds]


def classify(error: BaseException, what: str) -> BusError:
    """Map a huggingface_hub/httpx failure to NotFound, PermissionDenied or TransientBusError."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__
    text = scrub(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")[:200]
    if isinstance(error, (EntryNotFoundError, RevisionNotFoundError)):
        return NotFound(f"{what}: not found")
    if isinstance(error, RepositoryNotFoundError):
        return PermissionDenied(f"{what}: missing read permission, or the repo does not exist ({text})")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status in (401, 403):
            return PermissionDenied(f"{what}: missing permission (HTTP {status}: {text})")
        if status == 404:
            return NotFound(f"{what}: not found")
        if status in (408, 409, 412, 429) or status >= 500:
            transient = TransientBusError(f"{what}: HTTP {status} ({text})")
            retry_after = error.response.headers.get("Retry-After")
            if status == 429 and retry_after:
                with contextlib.suppress(ValueError):
                    transient.retry_after = float(retry_after)  # type: ignore[attr-defined]
            return transient
        return BusError(f"{what}: HTTP {status} ({text})")
    if isinstance(error, (httpx2.TransportError, OSError, TimeoutError)):
        return TransientBusError(f"{what}: {text}")
    return BusError(f"{what}: {text}")


class HubClient:
    """HfApi with timeouts, retries of transient failures and secret-free one-line errors."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
        retry_attempts: int = 8,
        request_timeout: float = 60.0,
        cache_dir: str | None = None,
    ) -> None:
        from huggingface_hub import HfApi

        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or PUBLIC_HUB).rstrip("/")
        token = token or env_token() or stored_login_token()
        if token:
            remember_secret(token)
        self.token = token
        self.retry_initial, self.retry_max, self.retry_attempts = retry_initial, retry_max, retry_attempts
        self.cache_dir = cache_dir
        install_timeout(request_timeout)
        self.api = HfApi(endpoint=self.endpoint, token=token)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient failures with exponential backoff (and 429's Retry-After)."""
        delay = self.retry_initial
        for attempt in range(self.retry_attempts + 1):
            try:
                return fn()
            except BusError:
                raise
            except Exception as error:
                failure = classify(error, what)
                if not isinstance(failure, TransientBusError) or attempt == self.retry_attempts:
                    raise failure from None
                # A 429's Retry-After is the server's word and is honoured as given (up to an hour).
                retry_after = getattr(failure, "retry_after", None)
                wait = (
                    min(retry_after, 3600.0)
                    if retry_after
                    else min(delay * (1 + 0.25 * random.random()), self.retry_max)
                )
                logger.warning(
                    "%s; retrying in %.1fs (%d/%d)", failure, wait, attempt + 1, self.retry_attempts
                )
                time.sleep(wait)
                delay = min(delay * 2, self.retry_max)
        raise AssertionError("unreachable")

    def sha(self, repo: str) -> str:
        """The repo's current commit: reads pinned to it never mix two versions of the repo."""
        info = self.call(f"{repo}: read", lambda: self.api.repo_info(repo))
        return info.sha  # type: ignore[return-value]

    def _download(self, repo: str, path: str, revision: str) -> bytes:
        if self.cache_dir:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = tempfile.mkdtemp(prefix="speedtronic-hub-", dir=self.cache_dir)
        try:
            local = self.call(
                f"{repo}: download {path}",
                lambda: self.api.hf_hub_download(repo, path, revision=revision, cache_dir=cache),
            )
            return Path(local).read_bytes()
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def _commit(self, repo: str, operations: list[Any], message: str) -> None:
        self.call(
            f"{repo}: write ({message})",
            lambda: self.api.create_commit(repo, operations, commit_message=message),
        )

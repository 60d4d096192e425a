"""The Hugging Face Hub client every Speedtronic Hub call goes through: DiLoCo's Hub bus
(diloco/bus/hub.py) and `speedtronic export --push-to-hub` (interop/hub_upload.py).

What it adds to huggingface_hub's HfApi:
- a timeout on every request, enforced in the transport (most HfApi calls pass `timeout=None`);
- retries with the project's one RetryPolicy (speedtronic/retry.py) for transient failures only (5xx,
  408, 409, 412, 429 with its Retry-After, timeouts, refused connections); permission errors fail at
  once;
- failures as one-line BusError / TransientBusError / PermissionDenied messages that name the repo
  and never contain the token (it is remembered as a secret and scrubbed);
- the token from the caller, then HF_TOKEN, then the stored `hf auth login`; the endpoint from the
  caller, then HF_ENDPOINT, then the public Hub;
- the Hub's limits, planned rather than hit: every HTTP request made inside `call()` takes a token
  from the client's request budget (`request_budget` requests per `request_window` seconds; the
  free tier's 1,000 per 5 minutes by default) and every commit one from that repo's commit budget
  (`commit_budget` per `commit_window`, the Hub's ~128 per hour). Both are token buckets that can
  never exceed the budget in any window (0.85 × budget refilled evenly plus a burst of 0.1 ×
  budget). A 429 empties the bucket until its Retry-After has passed, for every thread of the
  client, and is waited out without counting as a failed attempt: rate limits are never fatal
  (unless `retry_budget_s`, a cap on the total seconds one call may spend retrying, runs out —
  `hub status` uses a few seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from speedtronic import interrupts
from speedtronic.errors import BusError, PermissionDenied, TransientBusError
from speedtronic.retry import RetryPolicy
from speedtronic.secrets import env_token, remember_secret, scrub, stored_login_token

logger = logging.getLogger("speedtronic.diloco")
T = TypeVar("T")
PUBLIC_HUB = "https://huggingface.co"
_TIMEOUT_INSTALLED: list[float] = []
_CURRENT = threading.local()  # the HubClient whose call() runs on this thread (its budget pays)


class TokenBucket:
    """At most `budget` events in any `window` seconds: 0.85 × budget refilled evenly over the window
    plus a burst of 0.1 × budget (a margin of 5% for clock skew). `take()` blocks until a token is free; `block(s)` (a 429's
    Retry-After) empties the bucket for `s` seconds."""

    def __init__(self, budget: float, window: float, what: str) -> None:
        self.budget, self.window, self.what = budget, window, what
        self.rate = 0.85 * budget / window
        self.capacity = max(1.0, 0.1 * budget)
        self.tokens = self.capacity
        self.updated = time.monotonic()
        self.blocked_until = 0.0
        self.taken = 0
        self.waited_s = 0.0
        self.throttled = 0  # 429s answered to this budget's requests
        self.lock = threading.Lock()

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until `need` tokens are free (0: now)."""
        with self.lock:
            now = time.monotonic()
            self._refill(now)
            short = max(0.0, min(need, self.capacity) - self.tokens) / self.rate
            return max(short, self.blocked_until - now)

    def take(self) -> None:
        started = time.monotonic()
        logged = False
        while True:
            wait = self.wait_s()
            if wait <= 0:
                with self.lock:
                    self._refill(time.monotonic())
                    if self.tokens >= 1.0 and time.monotonic() >= self.blocked_until:
                        self.tokens -= 1.0
                        self.taken += 1
                        self.waited_s += time.monotonic() - started
                        return
                continue
            if wait > 2.0 and not logged:
                logged = True
                logger.info(
                    "%s: budget of %g per %gs spent; waiting %.0fs", self.what, self.budget, self.window, wait
                )
            if interrupts.wait(min(wait, 1.0)):  # a signal: no more waiting for the budget
                raise TransientBusError(
                    f"{self.what}: budget spent (not waited for: the process is stopping)"
                )

    def block(self, seconds: float) -> None:
        with self.lock:
            self.throttled += 1
            self.tokens = 0.0
            self.updated = time.monotonic()
            self.blocked_until = max(self.blocked_until, time.monotonic() + seconds)


class NotFound(BusError):
    pass


class TooLarge(BusError):
    """A downloaded file over the caller's size cap (`size`: its size); its bytes were never read."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class HubOffline(PermissionDenied):
    """HF_HUB_OFFLINE is set: the Hub is never contacted. Not a network failure to retry; fatal wherever
    a PermissionDenied is (a usage matter: exit 2), and said once."""

    exit_code = 2


def _offline(error: BaseException) -> bool:
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled) or isinstance(error.__cause__, OfflineModeIsEnabled):
        return True
    return bool(constants.HF_HUB_OFFLINE) and isinstance(error, OSError)  # the cache had nothing


class Stale(BusError):
    """A commit with `parent_commit` found that another commit came first (HTTP 412): the caller
    re-reads and decides; never retried as it is (it would fail the same way)."""


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
            client = getattr(_CURRENT, "client", None)
            if client is not None:
                client.requests.take()  # huggingface_hub's own retries pay too
            response = super().handle_request(request)
            if client is not None and response.status_code == 429:
                client.requests.block(retry_after(response.headers) or 1.0)
            return response

    def factory() -> Any:
        return httpx2.Client(
            transport=DeadlineTransport(),
            event_hooks={"request": [hf_request_event_hook]},
            follow_redirects=True,
            timeout=seconds,
        )

    set_client_factory(factory)
    _TIMEOUT_INSTALLED[:] = [seconds]


def retry_after(headers: Any) -> float | None:
    """Seconds a 429 asks to wait: Retry-After, else the reset of an exhausted RateLimit header."""
    value = headers.get("Retry-After")
    if value:
        with contextlib.suppress(ValueError):
            return max(0.0, float(value))
    limit = headers.get("RateLimit") or ""
    for part in limit.split(";"):
        if part.strip().startswith("t="):
            with contextlib.suppress(ValueError):
                return max(0.0, float(part.strip()[2:]))
    return None


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

    if _offline(error):
        return HubOffline(
            f"{what}: HF_HUB_OFFLINE is set, so the Hub is not contacted; unset HF_HUB_OFFLINE to use the "
            "Hub (or run on a file:// or s3:// bus)"
        )
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__
    # An LFS upload that failed (a 5xx from the storage, the connection refused) reaches us as
    # RuntimeError("Error while uploading … to the Hub.") raised from the HTTP error: judge the cause,
    # or a storage hiccup during a commit would count as a permanent failure.
    while type(error) is RuntimeError and isinstance(error.__cause__, Exception):
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
            if status == 429:
                transient.retry_after = retry_after(error.response.headers) or 1.0  # type: ignore[attr-defined]
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
        request_budget: int = 1000,
        request_window: float = 300.0,
        commit_budget: int = 128,
        commit_window: float = 3600.0,
        retry_budget_s: float | None = None,
    ) -> None:
        from huggingface_hub import HfApi

        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or PUBLIC_HUB).rstrip("/")
        token = token or env_token() or stored_login_token()
        if token:
            remember_secret(token)
        self.token = token
        self.retry_initial, self.retry_max, self.retry_attempts = retry_initial, retry_max, retry_attempts
        self.retry = RetryPolicy(retry_initial, retry_max, retry_attempts, retry_budget_s)
        self.cache_dir = cache_dir
        self.retry_budget_s = retry_budget_s
        self.requests = TokenBucket(request_budget, request_window, f"{self.endpoint} API requests")
        self.commit_budget, self.commit_window = commit_budget, commit_window
        self.commits: dict[str, TokenBucket] = {}
        install_timeout(request_timeout)
        self.api = HfApi(endpoint=self.endpoint, token=token)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn` under the client's RetryPolicy (speedtronic/retry.py): transient failures are
        retried with back-off, a 429 is waited out (its Retry-After, up to an hour) without counting
        as an attempt, unless the call's `retry_budget_s` runs out first. Every HTTP request made
        inside `fn` takes a token from this client's request budget."""

        def attempt() -> T:
            outer = getattr(_CURRENT, "client", None)
            _CURRENT.client = self
            try:
                return fn()
            finally:
                _CURRENT.client = outer

        return self.retry.call(what, attempt, classify)

    def commit_bucket(self, repo: str) -> TokenBucket:
        if repo not in self.commits:
            self.commits[repo] = TokenBucket(self.commit_budget, self.commit_window, f"{repo} commits")
        return self.commits[repo]

    def sha(self, repo: str) -> str:
        """The repo's current commit: reads pinned to it never mix two versions of the repo."""
        info = self.call(f"{repo}: read", lambda: self.api.repo_info(repo))
        return info.sha  # type: ignore[return-value]

    def _download(self, repo: str, path: str, revision: str, max_bytes: int | None = None) -> bytes:
        """The file's bytes; TooLarge (unread) when it is over `max_bytes`."""
        if self.cache_dir:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = tempfile.mkdtemp(prefix="speedtronic-hub-", dir=self.cache_dir)
        try:
            local = self.call(
                f"{repo}: download {path}",
                lambda: self.api.hf_hub_download(repo, path, revision=revision, cache_dir=cache),
            )
            size = Path(local).stat().st_size
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(f"{repo}: {path} is {size:,} bytes, over {max_bytes:,}", size)
            return Path(local).read_bytes()
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def _commit(
        self, repo: str, operations: list[Any], message: str, *, parent_commit: str | None = None
    ) -> Any:
        """One commit, paced by the repo's commit budget. With `parent_commit` it is a
        compare-and-swap: Stale when the repo's head is no longer that commit."""
        bucket = self.commit_bucket(repo)
        bucket.take()  # the Hub allows a repo ~128 commits per hour: pace them instead of hitting it

        def commit() -> Any:
            try:
                return self.api.create_commit(
                    repo, operations, commit_message=message, parent_commit=parent_commit
                )
            except Exception as error:
                failure = classify(error, repo)
                limited = getattr(failure, "retry_after", None)
                if limited is not None:
                    bucket.block(limited)
                status = getattr(getattr(error, "response", None), "status_code", None)
                if parent_commit is not None and status == 412:
                    raise Stale(f"{repo}: a commit came before this one ({message})") from None
                raise

        return self.call(f"{repo}: write ({message})", commit)

"""The client side of the S3 bus (speedtronic.diloco.bus.s3): the run URL and the endpoint, the botocore
client, and what each botocore failure means as a BusError.

boto3 is an optional extra, imported only by `make_client` (so naming or importing the bus never needs
it); without it opening an s3:// run is one ConfigError line. The client has botocore's own retries
off (one attempt) because speedtronic.retry retries; its timeouts are distributed.bus.request_timeout.
`classify` maps: 412 / 409 ConditionalRequestConflict → Conflict (the conditional write lost), 404 /
NoSuchKey → Missing, 403 and credential errors → PermissionDenied naming the key and the permission,
5xx / throttling / timeouts / connection errors → TransientBusError (with the store's Retry-After),
NotImplemented → Unsupported. Messages pass through speedtronic.secrets.scrub, which knows the secret
key and session token (`make_client` remembers them): no message or log line can carry them.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from speedtronic.errors import BusError, ConfigError, PermissionDenied, TransientBusError
from speedtronic.secrets import remember_secret, scrub

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

INSTALL_HINT = 'pip install "speedtronic-lm[s3]"'
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.=+-]+$")
_CONFLICT = {"PreconditionFailed", "ConditionalRequestConflict"}
_MISSING = {"NoSuchKey", "NotFound", "404"}
_UNSUPPORTED = {"NotImplemented", "InvalidArgument", "InvalidRequest", "501"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "403"}
_DENIED |= {"ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AccountProblem"}
_TRANSIENT = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded"}
_TRANSIENT |= {"RequestTimeout", "InternalError", "ServiceUnavailable", "OperationAborted"}


class Missing(BusError):
    """The key (or the bucket) is not there."""


class NotModified(BusError):
    """A GET with If-None-Match found the object still at that ETag (304, no body)."""


class Conflict(BusError):
    """A conditional request's precondition did not hold (412, or 409 ConditionalRequestConflict)."""


class Unsupported(BusError):
    """The store does not implement what the request asked (a conditional delete, say)."""


def parse_url(url: str) -> tuple[str, str]:
    """("bucket", "prefix") of s3://bucket/prefix; the prefix may be empty (the bucket's root)."""
    if not url.lower().startswith("s3://"):
        raise ConfigError(f"--repo {url!r}: an S3 run is s3://BUCKET/PREFIX")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ConfigError(f"--repo {url!r}: {bucket!r} is not a bucket name; use s3://BUCKET/PREFIX")
    parts = prefix.split("/") if prefix else []
    if any(p in (".", "..") or not _SEGMENT_RE.match(p) for p in parts):
        raise ConfigError(
            f"--repo {url!r}: the prefix must be /-separated names of letters, digits and ._=+- "
            "(no empty, '.' or '..' parts)"
        )
    return bucket, prefix


def resolve_endpoint(endpoint: str | None, config: BusConfig | None) -> str | None:
    """--endpoint, then distributed.bus.endpoint, then AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; None: AWS."""
    chosen = (
        endpoint
        or (getattr(config, "endpoint", None) if config is not None else None)
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if not chosen:
        return None
    parsed = urlparse(chosen)
    if parsed.username or parsed.password:
        raise ConfigError(
            "the S3 endpoint URL holds credentials; give them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "or ~/.aws instead"
        )
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"S3 endpoint {chosen!r} is not an http(s) URL, e.g. https://s3.hf.co")
    return chosen.rstrip("/")


def make_client(endpoint: str | None, timeout: float, region: str | None, style: str | None) -> Any:
    """A botocore S3 client on the standard credential chain; its secrets are remembered for scrub."""
    try:
        import boto3
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise ConfigError(f"s3:// runs need boto3, which is not installed: {INSTALL_HINT}") from None
    core = botocore.session.get_session()
    session = boto3.session.Session(botocore_session=core, region_name=region)
    credentials = session.get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        remember_secret(frozen.secret_key)
        remember_secret(frozen.token)
    if (
        style is None
        and endpoint is not None
        and "addressing_style" not in (core.get_config_variable("s3") or {})
    ):
        style = "path"  # MinIO and most self-hosted stores need it; R2 and the HF gateway take it
    config = Config(
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"mode": "standard", "max_attempts": 1},  # speedtronic.retry retries
        s3={"addressing_style": style} if style else None,
        # Checksums only where an operation requires them: some S3-compatible stores refuse
        # botocore's default flexible (CRC) checksums.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="speedtronic",
    )
    client = session.client("s3", endpoint_url=endpoint, config=config)
    members = client.meta.service_model.operation_model("PutObject").input_shape.members
    if "IfMatch" not in members or "IfNoneMatch" not in members:
        raise ConfigError(f"boto3 {boto3.__version__} cannot send conditional writes: {INSTALL_HINT} -U")
    return client


def _retry_after(value: Any) -> float | None:
    """Seconds of a Retry-After header (stores send seconds; an HTTP date counts as absent)."""
    try:
        return None if value is None else max(0.0, float(value))
    except (TypeError, ValueError):
        return None


def classify(error: Exception, where: str, permission: str, target: str, endpoint: str | None) -> BusError:
    """What a botocore failure of the request `where` (url: action) on `target` means, secret-free."""
    from botocore import exceptions as bx

    at = f" at {endpoint}" if endpoint else ""
    if isinstance(error, bx.ClientError):
        info = error.response.get("Error") or {}
        meta = error.response.get("ResponseMetadata") or {}
        code = str(info.get("Code") or "")
        status = int(meta.get("HTTPStatusCode") or 0)
        detail = scrub(str(info.get("Message") or code or f"HTTP {status}"))[:300]
        if status == 304:
            return NotModified(f"{where}: {target} is unchanged")
        if code in _CONFLICT or status == 412:
            return Conflict(f"{where}: {detail}")
        if code == "NoSuchBucket":
            return BusError(f"{where}: the bucket of {target} does not exist{at}; create it first")
        if code in _MISSING or status == 404:
            return Missing(f"{where}: {target} is missing")
        if code in _DENIED or status == 403:
            return PermissionDenied(
                f"{where}: access denied ({code or 'HTTP 403'}); the credentials need {permission} on {target}"
            )
        if status == 429 or (status >= 500 and code not in _UNSUPPORTED) or code in _TRANSIENT:
            failure = TransientBusError(f"{where}: {code or 'HTTP'} {status} ({detail})")
            wait = _retry_after((meta.get("HTTPHeaders") or {}).get("retry-after"))
            if wait is not None:
                failure.retry_after = wait  # type: ignore[attr-defined]
            return failure
        if code in _UNSUPPORTED or status == 501:
            return Unsupported(f"{where}: the store{at} does not support this request ({code}: {detail})")
        if code == "RequestTimeTooSkewed":
            return BusError(f"{where}: this machine's clock is too far off the store's; fix the clock")
        return BusError(f"{where}: {code or 'error'} (HTTP {status}): {detail}")
    if isinstance(error, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return PermissionDenied(
            f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a "
            "profile in ~/.aws (AWS_PROFILE), or run with an instance role"
        )
    if isinstance(error, (bx.ConnectionError, bx.HTTPClientError, OSError)):
        return TransientBusError(f"{where}: {type(error).__name__} talking to {endpoint or 'AWS S3'}")
    return BusError(f"{where}: {type(error).__name__}: {scrub(str(error))[:300]}")

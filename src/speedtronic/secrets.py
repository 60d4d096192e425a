"""Secrets (Hugging Face tokens): where they come from, and scrubbing them out of any text we print.

A token may come from the config, the `HF_TOKEN` environment variable, or huggingface_hub's stored
login. Every string that leaves the process through our code (logs, errors, dumps) can be passed
through `scrub`, which removes every token value seen so far and anything shaped like an HF token.
"""

from __future__ import annotations

import os
import re

REDACTED = "**********"
# Hugging Face user/org tokens look like hf_ followed by ~34 letters; match generously.
_HF_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{6,}")
_known_secrets: set[str] = set()


def remember_secret(value: str | None) -> None:
    """Record a secret value so `scrub` removes it wherever it appears."""
    if value and len(value) >= 4 and value != REDACTED:
        _known_secrets.add(value)


def scrub(text: str) -> str:
    """Return `text` with every known secret and every HF-token-shaped string replaced."""
    for secret in sorted(_known_secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _HF_TOKEN_PATTERN.sub(REDACTED, text)


def env_token() -> str | None:
    """The token in HF_TOKEN (or the older HUGGING_FACE_HUB_TOKEN), if any."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    remember_secret(token)
    return token or None


def stored_login_token() -> str | None:
    """The token saved by `hf auth login`, read lazily (huggingface_hub is only imported here)."""
    try:
        from huggingface_hub import get_token
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        return None
    token = get_token()
    remember_secret(token)
    return token


# Remember the environment's token at import so even early errors are scrubbed.
env_token()

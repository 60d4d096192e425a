"""Upload an exported folder to the Hugging Face Hub (`speedtronic export ... --push-to-hub REPO`).

One small, self-contained function on top of huggingface_hub (`HfApi.create_repo` + `upload_folder`).
The token comes from the caller, then HF_TOKEN, then the stored `hf auth login`; the endpoint from
`--endpoint`, then HF_ENDPOINT, then the public Hub. Failures become one-line SpeedtronicErrors that
never contain the token (it is remembered as a secret and scrubbed).
"""

from __future__ import annotations

import os
from pathlib import Path

from speedtronic.errors import SpeedtronicError
from speedtronic.secrets import env_token, remember_secret, scrub, stored_login_token


def resolve_token(token: str | None = None) -> str:
    token = token or env_token() or stored_login_token()
    if not token:
        raise SpeedtronicError(
            "no Hugging Face token for --push-to-hub: set HF_TOKEN or run `hf auth login` (a write token)"
        )
    remember_secret(token)
    return token


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    commit_message: str = "Upload model exported by speedtronic",
) -> str:
    """Create `repo_id` (a model repo; fine if it exists) and upload `folder` to it; returns its URL."""
    from huggingface_hub import HfApi

    token = resolve_token(token)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    where = endpoint or "the Hugging Face Hub"
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=commit_message
        )
    except Exception as error:  # network, HTTP and validation errors all become one line
        detail = " ".join(str(error).split())[:300] or type(error).__name__
        raise SpeedtronicError(
            scrub(
                f"could not push {folder} to {repo_id} at {where} ({type(error).__name__}: {detail}); "
                "check the repo id, the endpoint, your network and that the token may write"
            )
        ) from None
    return str(url)

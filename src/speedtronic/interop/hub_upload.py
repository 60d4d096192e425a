"""Upload an exported folder to the Hugging Face Hub (`speedtronic export ... --push-to-hub REPO`).

`HfApi.create_repo` + `upload_folder` through the shared client (speedtronic/hub_client.py), so a
push gets the same timeouts, retries of transient failures and secret-free errors as DiLoCo's Hub
bus. The token comes from the caller, then HF_TOKEN, then the stored `hf auth login`; the endpoint
from `--endpoint`, then HF_ENDPOINT, then the public Hub.
"""

from __future__ import annotations

from pathlib import Path

from speedtronic.errors import BusError, SpeedtronicError
from speedtronic.secrets import env_token, remember_secret, stored_login_token


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
    retry_attempts: int = 3,
) -> str:
    """Create `repo_id` (a model repo; fine if it exists) and upload `folder` to it; returns its URL."""
    from speedtronic.hub_client import HubClient

    client = HubClient(
        endpoint=endpoint, token=resolve_token(token), retry_initial=0.5, retry_attempts=retry_attempts
    )
    api = client.api
    try:
        url = client.call(
            f"{repo_id}: create", lambda: api.create_repo(repo_id, private=private, exist_ok=True)
        )
        client.call(
            f"{repo_id}: upload {folder}",
            lambda: api.upload_folder(
                repo_id=repo_id, folder_path=str(folder), commit_message=commit_message
            ),
        )
    except BusError as error:  # already one secret-free line naming the repo and the failure
        raise SpeedtronicError(
            f"could not push {folder} to {client.endpoint}/{repo_id} ({error}); check the repo id, the "
            "endpoint, your network and that the token may write"
        ) from None
    return str(url)

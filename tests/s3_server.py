"""A loopback S3 server for tests: moto's S3 service (the moto server's own WSGI app) on 127.0.0.1 in a
subprocess, answering one request at a time.

Why one at a time: moto's threaded server checks If-None-Match / If-Match and then writes, with no lock
between the two, so two racing conditional writes could in principle both pass; S3, R2 and MinIO
decide a conditional write atomically. A lock around each request gives the tests that atomicity
(moto enforces If-None-Match: * and If-Match on PUT, If-Match on GET and on DELETE).

`S3Server()` picks a free port, starts `python tests/s3_server.py PORT`, waits until it answers and
`stop()` kills it. `admin()` is a boto3 client with the test's credentials. `auth(True)` turns on
moto's IAM checks (POST /moto-api/reset-auth): requests then need an access key that moto's IAM knows
and a correct signature, so tests see real 403s (AccessDenied, InvalidAccessKeyId,
SignatureDoesNotMatch); `user(policy)` creates an IAM user with an inline policy while auth is off.
Run it by hand with `python tests/s3_server.py [PORT]`.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ACCESS_KEY = "AKIATESTSPEEDTRONIC1"
SECRET_KEY = "s3cr3t/Speedtronic+TestKey0123456789abcd"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    def __init__(self, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.port)], stdout=out, stderr=out, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the moto S3 server on port {self.port} did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def admin(self, **credentials: str) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=credentials.get("key", ACCESS_KEY),
            aws_secret_access_key=credentials.get("secret", SECRET_KEY),
        )

    def auth(self, on: bool) -> None:
        """Enforce IAM authentication and policies from now on (or stop)."""
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=b"0" if on else b"inf",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request, timeout=10).read()

    def user(self, name: str, statements: list[dict[str, Any]]) -> tuple[str, str]:
        """(access key, secret) of a new IAM user allowed `statements` (call with auth off)."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": statements}
        iam.put_user_policy(UserName=name, PolicyName="run", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]


def serve(port: int) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ: Any, start_response: Any) -> list[bytes]:
        with lock:  # the whole request, body included: a conditional write is atomic, as on S3
            return list(app(environ, start_response))

    run_simple("127.0.0.1", port, one_at_a_time, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)

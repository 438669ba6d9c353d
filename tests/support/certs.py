"""A private CA and a server certificate for 127.0.0.1, made with ``openssl``, for TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificates(folder: Path) -> dict[str, str]:
    """Write a CA and a certificate (with its key) for 127.0.0.1 it signed into ``folder``; their paths."""
    folder.mkdir()
    ca_key, ca, key, csr, cert = (str(folder / name) for name in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
        "-subj", "/CN=layertap-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
        "-extfile", str(ext))
    return {"ca": ca, "key": key, "cert": cert}

"""``layertap certify`` and ``layertap verify``: a run's certificate (``layertap.producer.files.certify``).

Exit codes: 0 certified (verified); 1 refused, a sampled row over its bound (the certificate is
written and says so), or a problem found (each named, the first 20 in full).
"""

from __future__ import annotations

from typing import Optional

import typer

from layertap.producer.cli.common import err_console, fail


def _say(message: str) -> None:
    err_console.print(message, markup=False, highlight=False)


def certify(
    run: str = typer.Argument(..., help="Run name."),
    checksums: bool = typer.Option(True, help="Check every tensor's checksum (reads every file whole)."),
    storage: Optional[str] = typer.Option(None, help="The run's storage root, folder or URL (setting storage_root): "
                                          "its files must lie under it; the certificate is written there."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Certify a complete run: write <root>/<run>/certificate.json (sealed by its content) and its file list,
    stating what its files are and the error measured on its sampled rows. Prints the certificate id."""
    from layertap.producer.cli.common import load_settings
    from layertap.producer.client.client import Client
    from layertap.producer.files.certify import CertifyRefused, certify as certify_run

    settings = load_settings(redis_url=redis_url, storage=storage)
    with Client(settings) as client:
        try:
            certificate = certify_run(client.redis, run, settings.storage(), checksums=checksums)
        except CertifyRefused as exc:
            raise fail(str(exc)) from None
    rows = len(certificate.samples)
    _say(f"run {run}: {certificate.files.count} file(s), {certificate.files.tokens} tokens; {rows} sampled row(s), "
         f"{rows - len(certificate.failed)} within their bound")
    if not rows:
        _say(f"warning: run {run} has no sampled rows (its workers ran with sample_every and sample_min 0, or "
             "answered every job from disk): its certificate states no measured error")
    print(certificate.certificate_id)
    if certificate.failed:
        raise fail(f"run {run} fails its certificate: " + "; ".join(f"sampled {row.describe()} is over its bound"
                                                                     for row in certificate.failed))


def verify(
    run: str = typer.Argument(..., help="Run name."),
    checksums: bool = typer.Option(True, help="Check every tensor's checksum (reads every file whole)."),
    storage: Optional[str] = typer.Option(None, help="The run's storage root, folder or URL (setting storage_root)."),
) -> None:
    """Check a run's certificate against its files (no Redis needed): its seal, its file list, and each file's
    checksums, states and identity."""
    from layertap.producer.cli.common import load_settings
    from layertap.producer.files.verify import verify as verify_run
    from layertap.protocol.certificate import CertificateError

    try:
        verdict = verify_run(load_settings(storage=storage).storage(), run, checksums=checksums)
    except CertificateError as exc:
        raise fail(str(exc)) from None
    if not verdict.ok:
        raise fail(f"run {run} does not match its certificate {verdict.certificate.certificate_id[:16]}...: "
                   f"{verdict.summary()}")
    _say(f"run {run}: {verdict.checked} file(s) match certificate {verdict.certificate.certificate_id}")


def register(app: typer.Typer) -> None:
    """Add ``certify`` and ``verify`` to the ``layertap`` app."""
    app.command()(certify)
    app.command()(verify)

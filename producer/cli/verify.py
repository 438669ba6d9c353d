"""``layertap certify`` and ``layertap verify``: a run's certificate (``layertap.producer.files.certify``).

Exit codes: 0 certified (verified); 1 refused, a sampled row over its bound (the certificate is
written and says so), or a problem found (each named, the first 20 in full). ``verify --recompute``
imports the worker side (``layertap.worker.job.fresh_sample``) when it runs.
"""

from __future__ import annotations

from typing import Optional

import typer

from layertap.extras import require
from layertap.producer.cli.common import err_console, fail


def _say(message: str) -> None:
    err_console.print(message, markup=False, highlight=False)


def certify(
    run: str = typer.Argument(..., help="Run name."),
    checksums: bool = typer.Option(True, help="Check every tensor's checksum (reads every file whole)."),
    storage: Optional[str] = typer.Option(None, help="The run's storage root, folder or URL (setting storage_root): "
                                          "its files must lie under it; the certificate is written there."),
    wait: float = typer.Option(60.0, min=0, help="Seconds to wait for sampled rows live workers still measure."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Certify a complete run: write <root>/<run>/certificate.json (sealed by its content) and its file list,
    stating what its files are and the error measured on its sampled rows. Prints the certificate id."""
    from layertap.producer.cli.common import load_settings
    from layertap.producer.client.client import Client
    from layertap.producer.files.certify import CertifyRefused
    from layertap.producer.files.certify import certify as certify_run

    settings = load_settings(redis_url=redis_url, storage=storage)
    with Client(settings) as client:
        try:
            certificate = certify_run(client.redis, run, settings.storage(), checksums=checksums, wait_s=wait)
        except CertifyRefused as exc:
            raise fail(str(exc)) from None
    rows = len(certificate.samples)
    _say(f"run {run}: {certificate.files.count} file(s), {certificate.files.tokens} tokens; {rows} sampled row(s), "
         f"{rows - len(certificate.failed)} within their bound")
    unmeasured = certificate.stated.get("unmeasured_samples", {})
    if unmeasured:
        _say(f"warning: {len(unmeasured)} sampled row(s) of run {run} were never measured: their worker(s) "
             f"{', '.join(sorted(set(unmeasured.values())))} stopped first (the certificate lists them)")
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
    recompute: int = typer.Option(0, min=0, help="Also compute this many certified files the workers did not "
                                  "sample again, each alone on this machine (needs the [worker] extra), and measure "
                                  "them as the workers measured their sampled rows."),
    model: Optional[str] = typer.Option(None, help="With --recompute: where the certified checkpoint is (default: "
                                        "the model source its files name; its weights fingerprint is checked)."),
    device: str = typer.Option("auto", help="With --recompute: the device to compute on."),
    storage: Optional[str] = typer.Option(None, help="The run's storage root, folder or URL (setting storage_root)."),
) -> None:
    """Check a run's certificate against its files (no Redis needed): its seal, its file list, and each file's
    checksums, states and identity; with --recompute, a fresh sample of its rows computed again alone."""
    from layertap.producer.cli.common import load_settings
    from layertap.producer.files.verify import file_lines
    from layertap.producer.files.verify import verify as verify_run
    from layertap.protocol.certificate import CertificateError

    files = load_settings(storage=storage).storage()
    try:
        verdict = verify_run(files, run, checksums=checksums)
        if recompute:
            require("`layertap verify --recompute`")
            from layertap.worker.job.fresh_sample import fresh_sample

            rows = fresh_sample(files, verdict.certificate, file_lines(files, verdict.certificate), recompute,
                                source=model, device=device)
            verdict.problems += [f"recomputed {row.describe()} is over its bound" for row in rows if not row.passed]
            _say(f"run {run}: {len(rows)} file(s) computed again alone on this machine, "
                 f"{sum(row.passed for row in rows)} within their bound")
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

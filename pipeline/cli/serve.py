"""`pipeline serve`: an artifact as a Ray Serve application."""

from __future__ import annotations

import click

from pipeline.runtime.continuous import MAX_SLOTS


@click.command()
@click.argument("artifact")
@click.option(
    "--replicas",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="replicas, each loading the artifact once",
)
@click.option("--address", default=None, help="an existing Ray cluster (ray://host:10001); default: a local one")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="HTTP port on 127.0.0.1")
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="session threads per replica (default: CPUs // replicas)",
)
@click.option("--max-body-bytes", type=int, default=None, help="largest request body; larger gets 413 (default: 1 MiB)")
@click.option("--max-texts", type=int, default=None, help="most texts a request; more gets 400 (default: 256)")
@click.option(
    "--body-timeout",
    type=float,
    default=None,
    help="seconds a request's body may take to arrive; later gets 408 (default: 10)",
)
@click.option(
    "--slots",
    type=click.IntRange(1, MAX_SLOTS),
    default=None,
    help="requests a decoder replica decodes together, each with a cache of max_length tokens (default: 16)",
)
def serve(artifact, replicas, address, port, threads, max_body_bytes, max_texts, body_timeout, slots) -> None:
    """Serve ARTIFACT over HTTP on 127.0.0.1 as a Ray Serve application: POST {"texts": [...]} to it. Every
    process it starts listens on loopback only (docs/serving.md: what is exposed, and how to expose it)."""
    from pipeline.serving.ray_serve import serve_forever

    serve_forever(
        artifact,
        replicas=replicas,
        address=address,
        port=port,
        threads=threads,
        max_body_bytes=max_body_bytes,
        max_texts=max_texts,
        body_timeout_s=body_timeout,
        slots=slots,
    )

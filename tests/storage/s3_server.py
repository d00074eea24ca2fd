"""A real S3-compatible server for the tests: moto's server mode, on loopback, over HTTP."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_server() -> Iterator[str]:
    """Start moto's threaded server on a free loopback port; yield its endpoint URL, with
    ``AWS_ENDPOINT_URL`` and test credentials set in the environment (spawned processes
    inherit them) until the end."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=url)
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def raw_client(endpoint: str, **config: Any) -> Any:
    """A boto3 client of the endpoint, independent of unickpt (to look at what is stored)."""
    import botocore.config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=ENV["AWS_DEFAULT_REGION"],
        config=botocore.config.Config(**config),
    )


def new_bucket(endpoint: str) -> str:
    """A fresh bucket; its name."""
    name = f"unickpt-{uuid.uuid4().hex[:12]}"
    raw_client(endpoint).create_bucket(Bucket=name)
    return name


def keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    pages = (
        raw_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    )
    return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))


def uploads(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    """Keys of the unfinished multipart uploads under ``prefix``."""
    resp = raw_client(endpoint).list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return sorted(u["Key"] for u in resp.get("Uploads", ()))

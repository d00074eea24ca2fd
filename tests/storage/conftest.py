from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.storage.s3_server import moto_server, new_bucket


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto server for the whole session; ``AWS_ENDPOINT_URL`` points at it."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the session's server."""
    return new_bucket(s3_endpoint)

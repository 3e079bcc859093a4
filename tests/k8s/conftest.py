"""Fixtures: a running fake API server with the two example pools' nodes."""

import pytest

from tests.k8s.fake_apiserver import FakeApiServer, two_pool_cluster

NAMESPACE = "tunefleet-training"


@pytest.fixture
def fake_api(tmp_path):
    with FakeApiServer(tmp_path / "k8s") as api:
        two_pool_cluster(api, namespace=NAMESPACE)
        yield api

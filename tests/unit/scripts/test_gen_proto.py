"""scripts/gen_proto.py: the committed generated modules are what the protos give, and OIP's messages live in a
descriptor pool of their own."""

import subprocess
import sys

import pytest
from google.protobuf import descriptor_pool

from disagg.api._proto import grpc_predict_v2_pb2
from disagg.rpc._proto import embedding_pb2
from tests.helpers import REPO

PACKAGES = {
    "disagg/rpc/_proto": ["embedding_pb2.py", "embedding_pb2_grpc.py"],
    "disagg/api/_proto": ["grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2_grpc.py"],
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen-proto")
    subprocess.run([sys.executable, "scripts/gen_proto.py", "--out", str(out)], cwd=REPO, check=True)
    return out


@pytest.mark.parametrize("package", list(PACKAGES))
def test_committed_generated_code_matches_the_proto(generated, package):
    names = sorted(path.name for path in (generated / package).glob("*.py"))
    assert names == PACKAGES[package]
    for name in names:
        committed = REPO / package / name
        assert committed.read_text() == (generated / package / name).read_text(), \
            f"{committed} is stale: run python scripts/gen_proto.py"


def test_oip_messages_stay_out_of_the_default_pool_and_the_embedding_service_is_in_it():
    """The default pool's ``inference.*`` names stay free for clients such as ``tritonclient.grpc``."""
    default = descriptor_pool.Default()
    assert grpc_predict_v2_pb2.DESCRIPTOR.pool is not default
    assert grpc_predict_v2_pb2.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
    assert embedding_pb2.DESCRIPTOR.pool is default

"""How Ray Serve's gRPC proxy registers the PagedServe service.

Like the generated ``add_PagedServeServicer_to_server``, except that bytes
which are no ``GenerateRequest`` decode to ``None`` instead of failing inside
grpc (status UNKNOWN): the replica then checks the API key and answers
INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from . import pagedserve_pb2 as pb

SERVICE_NAME = "pagedserve.PagedServe"


def parse_generate_request(data: bytes) -> pb.GenerateRequest | None:
    """The request, or None when ``data`` is no valid ``GenerateRequest``."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError:
        return None


def add_servicer_to_server(servicer, server) -> None:  # the signature grpc's generated code uses
    """Register ``servicer``'s ``Generate`` and ``GenerateStream`` on ``server``."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

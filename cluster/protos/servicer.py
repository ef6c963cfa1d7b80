"""How Ray Serve's gRPC proxy registers the PagedServe service.

Like the generated ``add_PagedServeServicer_to_server``, except that bytes
which are not a valid request message decode to ``None`` instead of failing
inside grpc (status UNKNOWN): the replica then checks the API key and answers
INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from . import pagedserve_pb2 as pb

SERVICE_NAME = "pagedserve.PagedServe"


def _lenient_parser(message_class):
    """A deserializer returning None, not raising, for bytes that are no ``message_class``."""
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return None
    return parse


parse_generate_request = _lenient_parser(pb.GenerateRequest)
parse_chat_request = _lenient_parser(pb.ChatRequest)

# RPC name -> (grpc's handler factory, request parser, response serializer).
_METHODS = {
    "Generate": (grpc.unary_unary_rpc_method_handler, parse_generate_request, pb.GenerateResponse),
    "GenerateStream": (grpc.unary_stream_rpc_method_handler, parse_generate_request, pb.GenerateResponse),
    "Chat": (grpc.unary_unary_rpc_method_handler, parse_chat_request, pb.ChatResponse),
    "ChatStream": (grpc.unary_stream_rpc_method_handler, parse_chat_request, pb.ChatResponse),
}


def add_servicer_to_server(servicer, server) -> None:  # the signature grpc's generated code uses
    """Register ``servicer``'s ``Generate``, ``GenerateStream``, ``Chat`` and ``ChatStream`` on ``server``."""
    handlers = {name: factory(getattr(servicer, name), request_deserializer=parse,
                              response_serializer=response.SerializeToString)
                for name, (factory, parse, response) in _METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

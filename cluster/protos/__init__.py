"""gRPC definitions: ``pagedserve.proto`` and the modules generated from it.

The ``*_pb2*.py`` files are generated (see the header of the .proto for the
command) and committed, so no build step is needed at install time.
"""

"""The serving layer: OpenAI-compatible HTTP and gRPC over a ``ClusterHandle``.

One concept per module; HTTP and gRPC depend on the frontend, never on each
other (``tests/test_import_graph.py`` checks this and that nothing imports in
a circle):

=====================  ==================================================================
``protocol``           OpenAI request and response models (pydantic)
``errors``             ``APIError`` and the mapping of failures onto it
``auth``               API-key check, client identity, the routes open without a key
``limits``             admission: requests in flight per replica and per client (429)
``stats``              the cluster stats snapshot (``/stats``, ``/metrics``)
``metrics``            Prometheus metrics of one replica
``frontend``           transport-neutral: prompt building and the prompt check, sampling
                       parameters, admission, the ``Generation`` fan-in with its timeouts
``sse``                server-sent events framing and stream lifetime
``serving_completion`` ``/v1/completions`` responses and stream
``serving_chat``       ``/v1/chat/completions`` responses and stream
``responses_protocol`` the Responses API's request and response models
``serving_responses``  ``/v1/responses`` over the chat path, and its named-event stream
``http_app``           the FastAPI app: routes, body parsing, API-key middleware, OpenAPI
``grpc_service``       the gRPC ``Generate``/``GenerateStream`` RPCs
``dashboard``          the live KV-cache dashboard (``/dashboard``)
``ingress``            what takes connections: Serve's proxy actor, or its HAProxy ingress
``deployment``         the Ray Serve replica class, ``build_application`` and ``deploy``
=====================  ==================================================================
"""

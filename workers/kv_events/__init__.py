"""KV events from a worker to the central KV manager: the link, the ZeroMQ wire and the per-node
relay. The link runs in the worker actor's process."""

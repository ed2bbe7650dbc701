"""tessera engine core: a scheduler over a paged KV cache, a model runner, and their gRPC server."""

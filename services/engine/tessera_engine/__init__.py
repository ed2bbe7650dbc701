"""tessera engine core: the seed's EngineCore (scheduler + executor) and its gRPC server."""

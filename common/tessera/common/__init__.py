"""Helpers every tessera service imports: flags, logging, model lookup, gRPC serving."""

"""tessera: shared code of the three services (generated stubs in tessera.v1, helpers in tessera.common)."""

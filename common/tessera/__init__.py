"""tessera: shared code of the three services (generated stubs in tessera.v1, helpers in tessera.common).

A namespace shared with tessera-client (tessera.client, in client/): pkgutil-style, so that
either distribution may be installed alone or both together."""
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

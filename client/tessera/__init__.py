"""tessera: a namespace shared by tessera-client (tessera.client, and tessera.v1 when installed
alone) and tessera-common (tessera.common, tessera.v1, the CLI)."""
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

"""Serving helpers: grpc.health.v1 and server reflection on every service."""
from __future__ import annotations

from typing import Iterable

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Metadata key carrying the request id between services.
REQUEST_ID_KEY = "x-request-id"

# Generous message limits: one engine step can carry many requests' logprobs.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class Health:
    """The standard health service for `service_names` plus the overall "" entry."""

    def __init__(self, server: grpc.aio.Server, service_names: Iterable[str]) -> None:
        self.servicer = health_async.HealthServicer()
        self.names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        for name in self.names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)


def request_id_from(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return value
    return None

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

# Channels between our services carry long-lived streams (the engine Session, the detokenize
# stream): keepalive pings find a peer that vanished without closing its connection (a killed
# container, a dropped network) within seconds instead of at the OS's TCP timeout.
CLIENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# Servers accept those pings (by default gRPC servers answer frequent pings with GOAWAY).
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


class Health:
    """The standard health service for `service_names` plus the overall "" entry."""

    def __init__(self, server: grpc.aio.Server, service_names: Iterable[str]) -> None:
        self.servicer = health_async.HealthServicer()
        self.names = ["", *service_names]
        self.serving = False  # the last status set, for the HTTP /health that must agree
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        self.serving = serving
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

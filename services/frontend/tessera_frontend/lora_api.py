"""vLLM's run-time LoRA endpoints, over every engine replica (`lora.LoRARegistry`):

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}
    POST /v1/unload_lora_adapter  {"lora_name"}

Registered only when the frontend runs with --allow-runtime-lora-updating (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), so without it they are 404 as any unknown path. Success is
200 with vLLM's plain-text body ("Success: LoRA adapter 'x' added successfully."); a failure is
an OpenAI-style JSON error: a missing field, a bad adapter directory, a name already taken or an
engine without --enable-lora 400, an unknown name 404 (vLLM's statuses), engines unreachable 503.
"""
from __future__ import annotations

from typing import Optional

import grpc
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tessera_frontend.lora import LoRAError, LoRARegistry
from tessera_frontend.openai_protocol import ApiError

# vLLM answers a name already loaded, and an engine without LoRA, 400 (not 409 / 412).
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
                grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


class LoadLoRAAdapterBody(BaseModel):
    """vLLM's LoadLoRAAdapterRequest (its other fields ignored); both are required, checked with a
    message naming whichever is missing."""
    model_config = ConfigDict(extra="ignore")

    lora_name: Optional[str] = None
    lora_path: Optional[str] = None


class UnloadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Optional[str] = None


def add_lora_routes(app: FastAPI, lora: LoRARegistry) -> None:
    """Register the load and unload routes on `app`."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterBody) -> PlainTextResponse:
        await _call(lora.load(body.lora_name or "", body.lora_path or ""))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterBody) -> PlainTextResponse:
        await _call(lora.unload(body.lora_name or ""))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _call(work):
    try:
        return await work
    except LoRAError as exc:
        status = _HTTP_STATUS.get(exc.code, 500)
        raise ApiError(status, exc.message, param=exc.param,
                       code="lora_not_found" if status == 404 else None) from None

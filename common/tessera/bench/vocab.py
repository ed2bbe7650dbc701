"""Tokenize and detokenize through the server under test, so that prompts are built from its
own vocabulary: over HTTP (/tokenize, /detokenize: tessera's frontend and vLLM both have them)
or over tessera's tokenizer gRPC service."""
from __future__ import annotations

from typing import Protocol

import grpc

from tessera.common.grpc_service import CHANNEL_OPTIONS
from tessera.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class Vocabulary(Protocol):
    async def tokenize(self, text: str) -> list[int]: ...
    async def detokenize(self, ids: list[int]) -> str: ...
    async def close(self) -> None: ...


class HttpVocabulary:
    """POST {base_url}/tokenize {"prompt"} and /detokenize {"tokens"}."""

    def __init__(self, client, base_url: str, model: str | None) -> None:
        self.client, self.base_url, self.model = client, base_url.rstrip("/"), model

    async def _post(self, path: str, body: dict) -> dict:
        if self.model:
            body = {"model": self.model, **body}
        reply = await self.client.post(f"{self.base_url}{path}", json=body)
        reply.raise_for_status()
        return reply.json()

    async def tokenize(self, text: str) -> list[int]:
        # no special tokens: the ids are for building and measuring prompts, not a template
        return list((await self._post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        return (await self._post("/detokenize", {"tokens": ids}))["prompt"]

    async def close(self) -> None:
        pass


class GrpcVocabulary:
    """tessera's TokenizerService (Tokenize / Detokenize) at `addr`."""

    def __init__(self, addr: str) -> None:
        self.channel = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)

    async def tokenize(self, text: str) -> list[int]:
        reply = await self.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=False),
                                         timeout=30)
        return list(reply.token_ids)

    async def detokenize(self, ids: list[int]) -> str:
        reply = await self.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=True),
                                           timeout=30)
        return reply.text

    async def close(self) -> None:
        await self.channel.close()


class WordVocabulary:
    """For a server without /tokenize (OpenAI's own): words of the text as tokens, so prompt
    lengths are approximate (the server's usage still reports the true ones)."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.index: dict[str, int] = {}

    async def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.index:
                self.index[word] = len(self.words)
                self.words.append(word)
            ids.append(self.index[word])
        return ids

    async def detokenize(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)

    async def close(self) -> None:
        pass

"""tessera frontend: the public APIs (gRPC and OpenAI-compatible HTTP) in front of the tokenizer and engines.

Modules, in the order a request meets them:

    grpc_api          FrontendService servicer: Generate (stream) / Complete (whole)
    openai_api        the OpenAI-compatible HTTP API (FastAPI): chat, completions, models, health
    openai_formatters OpenAI response bodies and stream chunks (chat and completion shapes)
    openai_protocol   OpenAI request bodies (pydantic) and their translation to tessera's SamplingParams
    http_server       uvicorn, run in the frontend's own event loop
    validation        field ranges and server caps shared by both APIs (INVALID_ARGUMENT / HTTP 400)
    admission         the cap on requests in flight (RESOURCE_EXHAUSTED / HTTP 429)
    async_llm         AsyncLLM.generate: tokenize, submit, yield outputs, abort on cancel
    router            picks the engine replica: fewest outstanding, prefix affinity
    discovery         engine addresses: parse, resolve (one replica per address), re-resolve
    engine_client     one Session stream per engine replica; health; submit / abort; per-step outputs
    output_processor  engine step outputs -> detokenized per-request outputs (pipelined, in order)
    tokenizer_client  GetModelInfo / Detokenize + the multiplexed tokenize and detokenize streams
    server            flags, wiring, health, reflection, shutdown
"""

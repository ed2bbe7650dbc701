"""tessera frontend: the public streaming gRPC API in front of the tokenizer and engine services.

Modules, in the order a request meets them:

    grpc_api          FrontendService servicer: validation, Generate / Complete
    async_llm         AsyncLLM.generate: tokenize, submit, yield outputs, abort on cancel
    router            picks the engine replica for a new request
    engine_client     one Session stream per engine replica; submit / abort; per-step output loop
    output_processor  engine step outputs -> detokenized per-request outputs
    tokenizer_client  unary Tokenize / GetModelInfo / Detokenize + the multiplexed detokenize stream
    server            flags, wiring, health, reflection, shutdown
"""

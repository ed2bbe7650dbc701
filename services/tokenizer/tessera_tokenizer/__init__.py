"""tessera tokenizer service: text <-> token ids and incremental detokenization over gRPC.

Modules: `tokenizer` (load the model's tokenizer, encode, chat templates, model facts),
`detokenizer` (per-request incremental decoding with stop strings), `detokenize_stream`
(the requests of one DetokenizeStream call, one reply per message), `chat_formats` (a family's
built-in chat template and end-of-turn token; --chat-template read), `gguf_metadata` (a GGUF
header read fast), `server` (the gRPC
TokenizerService and its flags; serving through `tessera.common.grpc_server`).
"""

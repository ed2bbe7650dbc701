"""tessera tokenizer service: text <-> token ids and incremental detokenization over gRPC.

Modules: `tokenizer` (load the model's tokenizer, encode, chat templates, model facts),
`detokenizer` (per-request incremental decoding with stop strings), `detokenize_stream`
(the requests of one DetokenizeStream call, one reply per message), `server` (the gRPC
TokenizerService and its flags; serving through `tessera.common.grpc_server`).
"""

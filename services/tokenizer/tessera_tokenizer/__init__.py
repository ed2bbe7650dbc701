"""tessera tokenizer service: text <-> token ids and incremental detokenization over gRPC.

Modules: `tokenizer` (load the model's tokenizer, encode, chat templates, model facts),
`detokenizer` (per-request incremental decoding with stop strings), `server` (the gRPC
TokenizerService, health, reflection, flags).
"""

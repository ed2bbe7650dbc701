"""`tessera bench`: a load generator for tessera or any OpenAI-compatible server.

One job per module: `vocab` (tokenize / detokenize through the server under test),
`datasets` (the prompts), `backends` (one streamed request per API), `load` (arrivals and
concurrency), `metrics` (figures from the per-request records), `report` (table and JSON),
`cli` (the flags, named as `vllm bench serve` names them).
"""

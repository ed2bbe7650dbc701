"""Streaming requests run through a frontend whose tokenizer is restarted or replaced mid-run
(for tests/stack/test_tokenizer_restart.py and test_tokenizer_replicas.py)."""
from __future__ import annotations

from tessera.v1 import common_pb2, frontend_pb2, tokenizer_pb2

QUESTIONS = ["Describe a lighthouse at night.", "Explain how bread rises.", "Write about a quiet library.",
             "Tell me about mountain weather.", "Describe the sound of rain.", "Explain why leaves turn red."]
MAX_TOKENS = 48


def _request(i: int, stop: list[str]) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=QUESTIONS[i])])
    return frontend_pb2.GenerateRequest(request_id=f"restart-{i}", chat=chat, sampling_params=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stop))



def _texts(stub, restart=None) -> list[tuple[str, int]]:
    """Run every question at once, streamed; `restart()` is called once each has its first output."""
    # a stop string that never matches still makes the tokenizer hold text back at times
    calls = [stub.Generate(_request(i, ["\u2603\u2603"]), timeout=180) for i in range(len(QUESTIONS))]
    firsts = [next(call) for call in calls]
    if restart is not None:
        restart()
    results = []
    for first, call in zip(firsts, calls):
        text, tokens = first.text, len(first.token_ids)
        for response in call:
            text += response.text
            tokens += len(response.token_ids)
        results.append((text, tokens))
    return results

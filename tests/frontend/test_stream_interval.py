"""--stream-interval: a frontend that sends a choice's tokens N at a time after its first.

A second frontend process with `--stream-interval 4` runs in front of the shared
tokenizer and engine; the same greedy requests go to it and to the default frontend
(interval 1). The answers must be identical once joined; only the message grouping
may differ: the first message of each choice carries its first token alone, every
other message but the last carries exactly 4, the last carries at most 4 and the
finish reason (and, for the request's last, the usage).
"""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from helpers.stack import frontend_service, serving, stack  # noqa: F401  (the session fixture)
from tessera.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc, tokenizer_pb2

pytestmark = pytest.mark.integration

INTERVAL = 4
QUESTION = "Name three rivers in Europe and say one thing about each."
RUNNING = common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.fixture(scope="module")
def grouped(stack):
    """A frontend with --stream-interval 4 in front of the shared backends, and its gRPC stub."""
    service = frontend_service("frontend-interval", stack.tokenizer.addr, stack.engine.addr, stack.log_dir,
                               "--stream-interval", str(INTERVAL))
    with serving(service) as channel:
        yield service, frontend_pb2_grpc.FrontendServiceStub(channel)


def _request(**params) -> frontend_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user", content=QUESTION)])
    return frontend_pb2.GenerateRequest(chat=chat, sampling_params=common_pb2.SamplingParams(**params))


def _by_choice(responses) -> dict[int, list[frontend_pb2.GenerateResponse]]:
    out: dict[int, list] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r)
    return out


def _joined(messages) -> tuple[str, list[int], list[int]]:
    return ("".join(m.text for m in messages), [t for m in messages for t in m.token_ids],
            [lp.chosen.token_id for m in messages for lp in m.logprobs])


def test_grouped_stream_equals_token_by_token(stack, grouped):
    _, stub = grouped
    # greedy, two choices, logprobs, 21 tokens (1 + 4 * 5): every grouping rule shows
    params = dict(temperature=0.0, max_tokens=21, ignore_eos=True, n=2, logprobs=2)
    plain = list(stack.frontend_stub.Generate(_request(**params), timeout=120))
    grouped_responses = list(stub.Generate(_request(**params), timeout=120))

    plain_choices, grouped_choices = _by_choice(plain), _by_choice(grouped_responses)
    assert sorted(grouped_choices) == [0, 1]
    for index, messages in grouped_choices.items():
        assert _joined(messages) == _joined(plain_choices[index])
        sizes = [len(m.token_ids) for m in messages]
        assert sizes == [1, 4, 4, 4, 4, 4], sizes
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        assert [m.finish_reason for m in messages[:-1]] == [RUNNING] * (len(messages) - 1)
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(grouped_responses) < len(plain)
    assert grouped_responses[-1].usage.completion_tokens == 42
    g_usage, p_usage = grouped_responses[-1].usage, plain[-1].usage
    assert (g_usage.prompt_tokens, g_usage.completion_tokens) == (p_usage.prompt_tokens, p_usage.completion_tokens)
    # the second run finds at least the first one's cached prompt (more: the first run's outputs
    # filled the prompt's last block, whose start a partial prefix hit then copies)
    assert g_usage.cached_prompt_tokens >= p_usage.cached_prompt_tokens
    assert not any(r.HasField("usage") for r in grouped_responses[:-1])


def test_grouped_stream_keeps_a_stop_string_cut(stack, grouped):
    _, stub = grouped
    reference = list(stack.frontend_stub.Generate(_request(temperature=0.0, max_tokens=40), timeout=120))
    text, _, _ = _joined(reference)
    words = text.split()
    assert len(words) > 6, text
    stop = words[5]  # a word from the middle of the answer
    params = dict(temperature=0.0, max_tokens=40, stop=[stop])
    plain = list(stack.frontend_stub.Generate(_request(**params), timeout=120))
    grouped_responses = list(stub.Generate(_request(**params), timeout=120))
    assert _joined(grouped_responses) == _joined(plain)
    assert grouped_responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert grouped_responses[-1].stop_reason == stop
    assert stop not in _joined(grouped_responses)[0]


def test_grouped_http_stream_with_the_openai_client(stack, grouped):
    service, _ = grouped
    messages = [{"role": "user", "content": QUESTION}]

    def stream(url: str) -> list:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return list(client.chat.completions.create(
            model="", messages=messages, temperature=0, max_tokens=13, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))

    plain, grouped_chunks = stream(stack.http_url), stream(service.http_url)
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # noqa: E731
    assert text(grouped_chunks) == text(plain) and text(plain)
    content = [c for c in grouped_chunks if c.choices and c.choices[0].delta.content]
    assert len(content) < len([c for c in plain if c.choices and c.choices[0].delta.content])
    assert grouped_chunks[-1].usage.completion_tokens == 13
    finish = [c.choices[0].finish_reason for c in grouped_chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_stream_interval_must_be_positive():
    result = subprocess.run([sys.executable, "-m", "tessera_frontend", "--stream-interval", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--stream-interval must be > 0" in result.stderr

"""tessera.bench.cli's flags in process: vLLM's names and meanings (--endpoint,
--request-timeout, the custom dataset, --header, --extra-body, --num-warmups, --metadata) and
usage errors that name the flag."""
from __future__ import annotations

import pytest

from tessera.bench import cli

pytestmark = pytest.mark.unit


def parse(*argv: str):
    parser = cli.build_parser()
    args = parser.parse_args(list(argv))
    cli.check(parser, args)
    return args


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_todays():
    args = parse()
    assert args.endpoint is None and args.request_timeout is None and args.headers == {}
    assert args.extra_body is None and args.num_warmups == 0 and args.metadata_dict == {}
    assert args.custom_output_len == 256  # vLLM's default


def test_vllm_flags_parse():
    args = parse("--backend", "openai-chat", "--base-url", "http://h:8000/v1", "--endpoint", "/v1/chat/completions",
                 "--request-timeout", "2.5", "--dataset-name", "custom", "--dataset-path", "q.jsonl",
                 "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--no-oversample",
                 "--header", "X-A=1", "X-B=a=b", "--extra-body", '{"temperature": 0.5}', "--num-warmups", "3",
                 "--metadata", "server=tessera", "--burstiness", "inf")
    assert args.base_url == "http://h:8000" and args.endpoint == "/v1/chat/completions"
    assert args.request_timeout == 2.5 and args.custom_output_len == -1
    assert args.dataset_name == "custom" and args.dataset_path == "q.jsonl"
    assert args.skip_chat_template and args.disable_shuffle and args.no_oversample
    assert args.headers == {"X-A": "1", "X-B": "a=b"} and args.extra_body == {"temperature": 0.5}
    assert args.num_warmups == 3 and args.metadata_dict == {"server": "tessera"}
    assert args.burstiness == float("inf")


@pytest.mark.parametrize("argv, named", [
    (["--endpoint", "v1/completions"], "--endpoint is a path starting with /"),
    (["--backend", "grpc", "--endpoint", "/v1/completions"], "--endpoint is for the HTTP backends"),
    (["--backend", "grpc", "--header", "a=b"], "--header is for the HTTP backends"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--request-timeout", "soon"], "--request-timeout"),
    (["--dataset-name", "custom"], "--dataset-path is required with --dataset-name custom"),
    (["--dataset-name", "custom", "--dataset-path", "q.json"], "a custom dataset is a .jsonl file"),
    (["--custom-output-len", "0"], "--custom-output-len must be > 0, or -1"),
    (["--header", "novalue"], "--header: expected KEY=VALUE, got 'novalue'"),
    (["--metadata", "=x"], "--metadata: expected KEY=VALUE"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--extra-body", "{bad"], "not JSON"),
    (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
])
def test_bad_values_are_usage_errors_naming_the_flag(capsys, argv, named):
    err = usage_error(capsys, *argv)
    assert named in err and "usage: tessera bench" in err

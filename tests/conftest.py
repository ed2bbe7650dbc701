"""Shared test setup: offline Hugging Face, quiet tokenizers, no metrics port unless a test picks one."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Service processes started by tests serve no /metrics unless the test gives them a port
# (tests/stack.py gives every service a free one), so parallel runs never fight over 9301-9303.
os.environ.setdefault("TESSERA_METRICS_PORT", "0")

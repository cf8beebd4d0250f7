"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): protocol.py holds its bodies and error
shape, messages.py runs a request through the same path as chat completions."""

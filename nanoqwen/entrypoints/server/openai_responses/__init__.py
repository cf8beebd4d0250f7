"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}): protocol.py holds its bodies,
store.py the stored responses, serving.py runs a request through the same path as chat completions."""

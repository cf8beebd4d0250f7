"""The bounded in-memory store of Responses API responses that GET / DELETE /v1/responses/{id} and
`previous_response_id` read (ServerState holds one).

It evicts least recently used first: creating, reading (GET) or continuing from a response
(`previous_response_id`) makes it the newest, so a conversation in use outlives one left alone. It is
touched only from the server's event loop, so it needs no lock. It does not survive a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nanoqwen.entrypoints.server.openai_responses.protocol import InputItem
from nanoqwen.entrypoints.server.protocol import APIError

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    """A response as GET answers it, and the input items it answered (the whole conversation
    before it, previous responses' included, without `instructions`)."""

    response: dict[str, Any]
    input_items: list[InputItem]


class ResponseStore:
    """The newest `max_responses` responses by id, least recently used evicted first."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._responses

    def put(self, stored: StoredResponse) -> None:
        response_id = stored.response["id"]
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The response, now the most recently used; a 404 in OpenAI's shape if it is not
        stored."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise _not_found(response_id, param)
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        if self._responses.pop(response_id, None) is None:
            raise _not_found(response_id, None)


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, or "
                         "evicted from the server's store of recent responses)",
                    param=param, code="response_not_found")

"""The responses the Responses API keeps: for ``GET``/``DELETE /v1/responses/{id}`` and for a
follow-up's ``previous_response_id``, which continues a kept response's conversation.

In the server's memory only, one store per server, bounded in count and in characters (the
least recently used go first): a server that restarts has kept nothing, and says so with a 404.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from localspec.api.responses_request import ChatMessage

RESPONSES_MAX_STORED = 256  # responses kept for previous_response_id and GET
RESPONSES_MAX_STORED_CHARS = 32 * 2**20  # and their conversations' text, all together



@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: list[ChatMessage]  # its messages (not its instructions), the answer last
    size: int  # characters, what the store's bound counts


class ResponseStore:
    """Responses kept in memory for ``previous_response_id`` and ``GET``: at most
    ``max_responses`` of them and ``max_chars`` of text all together, the least recently used
    going first. Thread-safe."""

    def __init__(self, max_responses: int = RESPONSES_MAX_STORED,
                 max_chars: int = RESPONSES_MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[ChatMessage]) -> None:
        size = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(response))
        with self._lock:
            self._drop(response["id"])
            self._kept[response["id"]] = StoredResponse(response, conversation, size)
            self._chars += size
            while len(self._kept) > 1 and (len(self._kept) > self.max_responses
                                           or self._chars > self.max_chars):
                self._drop(next(iter(self._kept)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is not None:
                self._kept.move_to_end(response_id)
            return kept

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._chars -= kept.size
        return kept is not None

    def __len__(self) -> int:
        return len(self._kept)

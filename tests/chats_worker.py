"""A process writing through ``ChatStore``, for the tests that need more than one process or a
process killed mid-answer (tests/test_chats_store.py, tests/test_chats_damage.py).

``python tests/chats_worker.py append DB CONVERSATION COUNT TAG``: append COUNT user messages
``TAG i`` to CONVERSATION, one transaction each, then exit.
``python tests/chats_worker.py stream DB``: a new conversation with a question, then an answer
that grows forever, saved as the app saves one (``AnswerSaver``); prints ``ready`` after the
first write; meant to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localspec.chats.answers import AnswerSaver  # noqa: E402
from localspec.chats.store import ChatStore, Message  # noqa: E402

QUESTION = "Tell me a story that never ends."
WORD = "once upon a time "


def append(db: str, conversation: str, count: str, tag: str) -> None:
    with ChatStore(Path(db)) as store:
        for i in range(int(count)):
            store.append(int(conversation), Message("user", f"{tag} {i}"))


def stream(db: str) -> None:
    with ChatStore(Path(db)) as store:
        conversation, _ = store.create([Message("user", QUESTION)])
        saver = AnswerSaver(store, conversation, preset="tiny", settings={"temperature": 0.0},
                            every_tokens=4, every_s=10.0)
        text, tokens = "", 0
        while True:
            text += WORD
            tokens += 1
            if saver.update(text, tokens) and saver.writes == 1:
                print("ready", flush=True)
            time.sleep(0.002)


if __name__ == "__main__":
    {"append": append, "stream": stream}[sys.argv[1]](*sys.argv[2:])

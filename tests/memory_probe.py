"""RSS measures for ``test_memory.py``, each in a fresh process (run by the tests, not pytest).

Why a process of its own: what held the memory is oneDNN's primitive cache, which is process
wide and bounded (1,024 primitives): in a pytest process that has already run other tests it
may be full, and then new primitives only replace old ones, hiding the growth a user's app
shows. RSS is read after ``gc.collect()`` and glibc's ``malloc_trim(0)``: freed memory that
malloc keeps for reuse (as large as the largest transient, a long prompt's activations) is
returned, so what remains is what something holds.

``test_memory`` also fixes malloc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``, read as the
process starts). By default it rises to the largest block freed so far (up to 32 MB); such
blocks then come from the heap, where they fragment what ``malloc_trim`` can give back, and one
conversation's RSS rose and fell by 10-20 MB from answer to answer. Fixed, large blocks
(activations, the KV cache) are mapped on their own and resident as far as they are written:
the same conversation's RSS then grew 1.5-2.3 MB an answer, with the KV cache's filling, the
same to 0.5 MB in two runs. And before the first answer every int8 row count the answers will
use is warm (``warm_row_counts``).

Usage: ``python tests/memory_probe.py linear``, ``... app ANSWERS CLEAR_EVERY MAX_NEW_TOKENS`` or
``... api REQUESTS MAX_NEW_TOKENS``; prints one JSON object (exit status 3 without glibc's
``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import httpx
import psutil
import torch

from localspec.api.local_server import serve_in_thread
from localspec.host import ModelHost
from localspec.models.hardware import detect_hardware
from localspec.runtime.quant import EXACT_ROWS, ROW_PIECE, ROW_STEP, W8A8Linear
from localspec.ui.app import ChatApp, Settings

MB = 2**20
NO_TRIM = 3  # exit status: this libc has no malloc_trim
SMOL = "cpu-smollm2-ngram"
# Topics of different lengths, so that every answer's prompt has a length of its own (as in a
# real conversation; each new length was new oneDNN primitives).
TOPICS = ("rain", "the moon", "a red bicycle", "bread", "rivers and the sea", "owls", "snow",
          "the first computers", "tea", "a lighthouse on a rocky coast", "bees", "clocks",
          "mountains in winter", "paper", "a small garden with tomatoes", "trains", "salt",
          "the colour blue", "maps", "an old wooden bridge over a stream", "wind", "music",
          "the number seven", "glass", "a cat that sleeps all day", "bridges", "ice", "books",
          "volcanoes", "a kite on a windy afternoon", "sand", "honey", "stars at night", "ink",
          "a library", "frogs", "the wheel", "copper", "a market in the morning", "clouds",
          "soap", "the alphabet", "a boat", "fire", "shoes", "an orchard of apple trees",
          "whales", "chess", "the sun", "a quiet street after the rain")


def settled_rss(trim: Callable[[int], int]) -> float:
    """The process's RSS in MB once Python's garbage and malloc's free memory are returned."""
    gc.collect()
    trim(0)
    return psutil.Process().memory_info().rss / MB


def linear(trim: Callable[[int], int]) -> dict[str, float]:
    """A 576 -> 3072 int8 layer (SmolLM2's gate/up) fed 100 row counts never seen before (100
    prompt lengths), after the counts a long feed uses are warm: RSS before and after."""
    layer = W8A8Linear.from_float(torch.randn(3072, 576,
                                              generator=torch.Generator().manual_seed(1)))
    for n in (300, 301, 555, 777):
        layer(torch.randn(n, 576))
    before = settled_rss(trim)
    for n in range(1301, 2301, 10):
        layer(torch.randn(n, 576))
    return {"before": before, "after": settled_rss(trim)}


def warm_row_counts(decoder: object) -> int:
    """Run each int8 layer shape of ``decoder`` (its first layer's four and the head) once on
    every row count ``W8A8Linear`` hands oneDNN, so that its primitives exist before the first
    answer: otherwise each verify width or prompt piece first met later (adaptive k's widths
    vary with the drafter's evidence) costs ~1.6 MB then, bounded but not the KV cache. The
    number of layers warmed."""
    first = decoder.layers[0]
    linears = [layer for layer in (first.qkv, first.o, first.gate_up, first.down,
                                   decoder.head.part(None)) if isinstance(layer, W8A8Linear)]
    counts = [*range(1, EXACT_ROWS + 1), *range(ROW_STEP, ROW_PIECE + 1, ROW_STEP)]
    for layer in linears:
        for rows in counts:
            layer(torch.ones(rows, layer.in_features))
    return len(linears)


def app(trim: Callable[[int], int], count: int, clear_every: int,
        max_new_tokens: int) -> dict[str, list]:
    """The app's chat handler on SmolLM2: ``count`` questions, Clear every ``clear_every``;
    after each answer the settled RSS, the part of the KV cache's allocation the context fills
    (MB), and the context's length."""
    host = ModelHost(audit=False)
    if not host.load(SMOL):
        raise SystemExit(f"could not load {SMOL}: {host.status().error}")
    chat = ChatApp(host, detect_hardware(), SMOL, min_update_interval=0.0,
                   stop_wait_s=0.0).chat
    runner = host.pipeline.target_runner()
    if not warm_row_counts(runner.decoder):
        raise SystemExit(f"{SMOL} has no int8 layers: this probe measures oneDNN's")
    settings = Settings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                        k=8, seed=0)
    history: list[dict] = []
    points: dict[str, list] = {"rss": [], "kv_used": [], "context": [], "turns": [],
                               "notices": []}
    for i in range(count):
        if i and i % clear_every == 0:
            history = chat.clear().history
        # the last view of the answer (the handler streams many; Gradio keeps the last)
        (last,) = deque(chat.send(f"Tell me about {TOPICS[i % len(TOPICS)]}.", history,
                                  settings), maxlen=1)
        history = last.history
        cache = runner.kv_cache
        points["rss"].append(settled_rss(trim))
        allocated = (cache.keys.nbytes + cache.values.nbytes) / MB
        points["kv_used"].append(allocated * runner.length / cache.keys.shape[2])
        points["context"].append(runner.length)
        points["turns"].append(len(history))
        points["notices"].append(last.notice)
    return points


def _chat(client: httpx.Client, topic: str, max_new_tokens: int, stream: bool) -> int:
    """One greedy chat request over HTTP, read to its end; the answer's token count."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": f"Tell me about {topic}."}],
                               "max_tokens": max_new_tokens, "temperature": 0}
    if not stream:
        response = client.post("/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])
    body.update(stream=True, stream_options={"include_usage": True})
    tokens = None
    with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens = json.loads(line.removeprefix("data: ")).get("usage", tokens)
    if tokens is None:
        raise SystemExit("a streamed answer ended without its usage")
    return int(tokens["completion_tokens"])


def _workers_ended(timeout: float = 30.0) -> None:
    """Wait until the API's worker threads (``api-<request id>``) have ended: a request's
    worker finishes just after its client has the last byte."""
    deadline = time.monotonic() + timeout
    while any(t.name.startswith(("api-chatcmpl-", "api-cmpl-")) for t in threading.enumerate()):
        if time.monotonic() > deadline:
            raise SystemExit("an API worker thread did not end")
        time.sleep(0.01)


def api(trim: Callable[[int], int], count: int, max_new_tokens: int) -> dict[str, list]:
    """SmolLM2 served by the API (uvicorn in a thread of this process, on a loopback port):
    ``count`` chat requests over real HTTP, every other one streamed, each on a topic of its
    own; after each answer (and its worker thread's end) the settled RSS and its token count."""
    host = ModelHost(audit=False)
    if not host.load(SMOL):
        raise SystemExit(f"could not load {SMOL}: {host.status().error}")
    warm_row_counts(host.pipeline.target_runner().decoder)
    points: dict[str, list] = {"rss": [], "tokens": []}
    with serve_in_thread(host) as url, httpx.Client(base_url=url, timeout=600,
                                                   trust_env=False) as client:
        for i in range(count):
            points["tokens"].append(_chat(client, TOPICS[i % len(TOPICS)], max_new_tokens,
                                          stream=i % 2 == 1))
            _workers_ended()
            points["rss"].append(settled_rss(trim))
    return points


def main(argv: list[str]) -> int:
    path = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(path), "malloc_trim", None) if path else None
    if trim is None:
        return NO_TRIM
    if argv[0] == "linear":
        result = linear(trim)
    elif argv[0] == "api":
        result = api(trim, *map(int, argv[1:3]))
    else:
        result = app(trim, *map(int, argv[1:4]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

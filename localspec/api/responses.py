"""OpenAI's response shapes, built from a job's events, plus what only LocalSpec returns.

Every completion carries ``usage`` and a ``speculation`` object (the method, k, drafts made and
accepted, tokens per target pass, speed, time spent drafting and verifying). A request that
asks for ``localspec.tokens`` also gets each token with its kind (``accepted`` draft, the
target's ``recovered`` token after a rejection or ``bonus`` token after a fully accepted draft,
``plain`` when nothing was drafted), its probability under the target (and the drafter's, for
a draft), and, on a recovered token, the drafts it replaced: what the app colours.
"""

from __future__ import annotations

from collections.abc import Iterable

from localspec.api.service import Job
from localspec.engine.engine import StepEvent
from localspec.engine.spans import TokenSpan, TokenTexts, event_spans

# The engine's reasons, as OpenAI names them (a stop string and the end-of-sequence token are
# both "stop"; a cancelled generation has no client left to read it).
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
KIND = {"accepted": "accepted", "recovered": "recovered", "bonus": "bonus", "target": "plain"}


def token_texts(job: Job) -> TokenTexts:
    decode = job.pipeline.tokenizer.decode
    return TokenTexts(lambda ids: decode(ids, skip_special_tokens=True))


def _token(span: TokenSpan) -> dict[str, object]:
    entry: dict[str, object] = {"id": span.token_id, "text": span.text,
                                "kind": KIND.get(span.kind, span.kind)}
    if span.p_target is not None:
        entry["p_target"] = round(span.p_target, 6)
    if span.q_draft is not None:
        entry["q_draft"] = round(span.q_draft, 6)
    return entry


def step_tokens(event: StepEvent, texts: TokenTexts) -> list[dict[str, object]]:
    """The tokens one step added, in order; the drafts it rejected go with the recovered token
    that replaced them (drafts past a cut-off, with no token replacing them, are left out)."""
    tokens, rejected = [], []
    for span in event_spans(event, texts):
        if span.kind == "rejected":
            rejected.append({"id": span.token_id, "text": span.text,
                             **({"q_draft": round(span.q_draft, 6)}
                                if span.q_draft is not None else {})})
            continue
        entry = _token(span)
        if span.kind == "recovered" and rejected:
            entry["rejected"] = rejected
            rejected = []
        tokens.append(entry)
    return tokens


def usage(job: Job) -> dict[str, object]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens a conversation's cache already held."""
    completion = job.stats.new_tokens
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": job.stats.cached_tokens}}


def speculation(job: Job) -> dict[str, object]:
    s = job.stats
    return {"method": job.method, "k": job.request.num_speculative_tokens,
            "adaptive": job.request.adaptive, "drafted": s.drafted, "accepted": s.accepted,
            "acceptance": round(s.acceptance_rate, 4),
            "tokens_per_pass": round(s.mean_accepted_length, 3),
            "target_passes": s.target_forward_passes,
            "tokens_per_second": round(s.tokens_per_second, 2),
            "draft_time_s": round(s.draft_time, 4), "verify_time_s": round(s.verify_time, 4),
            "wall_time_s": round(s.wall_time, 4)}


def _head(job: Job, object_name: str) -> dict[str, object]:
    return {"id": job.id, "object": object_name, "created": job.created, "model": job.model,
            "system_fingerprint": f"localspec-{job.method}"}


def completion(job: Job, kind: str, events: Iterable[StepEvent]) -> dict[str, object]:
    """The whole answer (``stream: false``)."""
    events = list(events)
    text = "".join(e.text_delta for e in events)
    reason = FINISH.get(events[-1].finish_reason or "", "stop") if events else "stop"
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                          "refusal": None}, "logprobs": None,
                  "finish_reason": reason}
        body = _head(job, "chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = _head(job, "text_completion")
    body.update(choices=[choice], usage=usage(job), speculation=speculation(job))
    if job.want_tokens:
        texts = token_texts(job)
        body["localspec"] = {"tokens": [t for e in events for t in step_tokens(e, texts)]}
    return body


def chunk(job: Job, kind: str, text: str | None, reason: str | None = None,
          role: bool = False, tokens: list[dict[str, object]] | None = None,
          ) -> dict[str, object]:
    """One server-sent event of a stream: a piece of text (``role``: the first, which names the
    assistant), and on the last one the finish reason and the speculation so far."""
    if kind == "chat":
        delta: dict[str, object] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        body = _head(job, "chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": reason}]
    else:
        body = _head(job, "text_completion")
        body["choices"] = [{"index": 0, "text": text or "", "logprobs": None,
                            "finish_reason": reason}]
    if reason is not None:
        body["speculation"] = speculation(job)
    if tokens is not None:
        body["localspec"] = {"tokens": tokens}
    return body


def usage_chunk(job: Job, kind: str) -> dict[str, object]:
    """The stream's last event when ``stream_options.include_usage`` asks for it."""
    body = _head(job, "chat.completion.chunk" if kind == "chat" else "text_completion")
    body.update(choices=[], usage=usage(job), speculation=speculation(job))
    return body


def finish_reason(event: StepEvent) -> str | None:
    return FINISH.get(event.finish_reason) if event.finish_reason is not None else None

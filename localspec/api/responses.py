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
from localspec.api.tool_calls import CallReader, Piece, read_answer
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
        message: dict[str, object] = {"role": "assistant", "content": text, "refusal": None}
        if job.plan.reader is not None:
            message["content"], calls = read_answer(text, job.plan.reader, job.plan.functions)
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
                reason = calls_reason(reason)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        body = _head(job, "chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = _head(job, "text_completion")
    body.update(choices=[choice], usage=usage(job), speculation=speculation(job))
    if job.want_tokens:
        texts = token_texts(job)
        body["localspec"] = {"tokens": [t for e in events for t in step_tokens(e, texts)]}
    return body


def calls_reason(reason: str) -> str:
    """The finish reason of an answer that made tool calls: ``tool_calls``, unless the token
    limit cut it (a call it cut short came back as text)."""
    return reason if reason == "length" else "tool_calls"


def chunk(job: Job, kind: str, text: str | None, reason: str | None = None,
          role: bool = False, tokens: list[dict[str, object]] | None = None,
          tool_call: dict[str, object] | None = None) -> dict[str, object]:
    """One server-sent event of a stream: a piece of text (``role``: the first, which names the
    assistant) or of a tool call, and on the last one the finish reason and the speculation so
    far."""
    if kind == "chat":
        delta: dict[str, object] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
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


def call_deltas(index: int, piece: Piece) -> list[dict[str, object]]:
    """A whole call as OpenAI streams one: its id, type and name (arguments empty), then its
    arguments."""
    call = piece.call
    assert call is not None
    return [{"index": index, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]


class ChatStream:
    """The chunks of a streamed chat answer, step by step: text as content, and, when the
    request offered tools, text that may be a call held back until it is read (``CallReader``),
    then the call as ``tool_calls`` deltas; ``tool_calls`` is the finish reason of an answer
    that made calls. The finish reason goes with the step's last piece of text, or alone."""

    def __init__(self, job: Job) -> None:
        self.job = job
        plan = job.plan
        self.reader = (CallReader(plan.reader, plan.functions) if plan.reader is not None
                       else None)
        self._calls = 0  # calls sent so far: the next one's index

    def step(self, event: StepEvent, tokens: list[dict[str, object]] | None,
             ) -> list[dict[str, object]]:
        """The chunks for one step (its tokens go with the first, or with an empty chunk)."""
        reason = finish_reason(event)
        if self.reader is None:
            pieces = [Piece(text=event.text_delta)] if event.text_delta else []
        else:
            pieces = self.reader.feed(event.text_delta)
            if reason is not None:
                pieces += self.reader.finish()
                if self.reader.calls:
                    reason = calls_reason(reason)
        last_text = pieces.pop().text if pieces and pieces[-1].call is None and reason \
            else None
        chunks: list[dict[str, object]] = []
        for piece in pieces:
            if piece.call is None:
                chunks.append(chunk(self.job, "chat", piece.text))
                continue
            chunks += [chunk(self.job, "chat", None, tool_call=delta)
                       for delta in call_deltas(self._calls, piece)]
            self._calls += 1
        if reason is not None:
            chunks.append(chunk(self.job, "chat", last_text, reason))
        if tokens:
            if not chunks:
                chunks.append(chunk(self.job, "chat", None))
            chunks[0]["localspec"] = {"tokens": tokens}
        return chunks

    def end(self) -> list[dict[str, object]]:
        """The last chunks of an answer that ended without a last step: what was held back,
        and the finish reason ``stop``."""
        return self.step(END, None)


# A step that adds nothing and ends the answer (``ChatStream.end``).
END = StepEvent(step=0, k=0, drafted=(), accepted=0, target_token=None,
                target_token_kind="bonus", tokens=(), p_target=(), q_draft=(), text_delta="",
                draft_time=0.0, verify_time=0.0, finish_reason="stop")

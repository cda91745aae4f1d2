"""Request bodies of /v1/chat/completions and /v1/completions, validated into a `DecodeRequest`.

Statuses (errors.APIError): 400 a parameter this engine does not honour (n > 1, logprobs, tools,
penalties, top_p/top_k at temperature > 0 ...); 404 a model this server does not serve; 413 a
prompt that leaves no room in the model's context; 422 a field of the wrong type or value (missing
or empty messages, unknown roles, max_tokens < 1 or past the context, temperature < 0 or NaN, a
seed outside [0, 2**64), bad stop strings). Fields OpenAI defines that change nothing here
(user, metadata, store, ...) are accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..cli import chat_ids, has_chat_template, prompt_ids
from .errors import APIError

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4  # as OpenAI's API: up to 4 stop strings
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 1 << 20  # default request body limit (a 2048-token prompt is ~10 kB)


@dataclass(frozen=True)
class Served:
    """What requests are checked against: the served model and its decoder's context.

    model_id:     the one name `model` may carry (GET /v1/models lists it)
    tokenizer:    the target's tokenizer (its chat template for chat requests)
    vocab_size:   token ids of a token-list prompt must lie in [0, vocab_size)
    room:         prompt length -> the most new tokens that fit after it (< 1: none)
    default_seed: the sampling seed of a request without one
    """

    model_id: str
    tokenizer: Any
    vocab_size: int
    room: Callable[[int], int]
    default_seed: int = 0


@dataclass(frozen=True)
class DecodeRequest:
    """One validated request.

    kind:          "chat" (/v1/chat/completions) or "text" (/v1/completions)
    prompt_ids:    list[int]: the prompt's tokens (chat: messages through the chat template)
    max_tokens:    new tokens at most, >= 1, within the context
    temperature:   >= 0 (0: greedy)
    seed:          position-keyed sampling seed in [0, 2**64) (read at temperature > 0)
    stop:          strings that end the answer where they first appear (not included)
    stream:        answer as server-sent events
    include_usage: streamed: a last chunk carries usage (stream_options.include_usage)
    """

    kind: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_request(kind: str, body: Any, served: Served) -> DecodeRequest:
    """A DecodeRequest from a parsed JSON body (kind "chat" or "text"); raises APIError."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise APIError(404, f"model {model!r} is not served here; this server serves "
                            f"{served.model_id!r} (GET /v1/models)", "model", "model_not_found")
    temperature = _temperature(body.get("temperature"))
    _refuse_unsupported(body, kind, temperature)
    ids = _chat_prompt(body.get("messages"), served) if kind == "chat" else \
        _text_prompt(body.get("prompt"), served)
    room = served.room(len(ids))
    if room < 1:
        raise APIError(413, f"the prompt has {len(ids)} tokens: it leaves no room for an answer "
                            f"in the model's context ({len(ids) + room - 1} prompt tokens at most)",
                       "messages" if kind == "chat" else "prompt", "context_length_exceeded")
    default = room if kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise APIError(422, f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(422, f"stream_options must be an object, got {_kind(options)}",
                       "stream_options")
    return DecodeRequest(kind=kind, prompt_ids=ids,
                         max_tokens=_max_tokens(body, len(ids), room, default),
                         temperature=temperature, seed=_seed(body.get("seed"), served.default_seed),
                         stop=_stop(body.get("stop")), stream=bool(stream),
                         include_usage=bool(stream) and options.get("include_usage") is True)


# ------------------------------------------------------------------------------------ prompts


def _chat_prompt(messages: Any, served: Served) -> list[int]:
    """The prompt tokens of a chat request's messages (through the chat template)."""
    if messages is None:
        raise APIError(422, "messages is required: a non-empty list of {role, content}", "messages")
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else _kind(messages)
        raise APIError(422, f"messages must be a non-empty list of {{role, content}}, got {got}",
                       "messages")
    turns = [_message(i, m) for i, m in enumerate(messages)]
    tokenizer = served.tokenizer
    if not has_chat_template(tokenizer):
        if len(turns) != 1 or turns[0]["role"] != "user":
            raise APIError(400, "this model has no chat template: send one user message (its "
                                "text is the prompt, as `dartree generate` does), or use "
                                "/v1/completions",
                           "messages", "no_chat_template")
        return prompt_ids(tokenizer, turns[0]["content"])[0].tolist()
    try:
        return chat_ids(tokenizer, turns)[0].tolist()
    except Exception as exc:  # the template is the model's own code: its refusals are bad input
        raise APIError(422, f"messages do not fit the model's chat template: {exc}",
                       "messages") from None


def _message(index: int, message: Any) -> dict[str, str]:
    """{"role", "content"} with the content as one string (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(422, f"{where} must be an object with role and content, got "
                            f"{_kind(message)}", where)
    role = message.get("role")
    if role not in ROLES:
        raise APIError(422, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                       f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise APIError(422, f"{where}.content[{j}] must be a text part "
                                    f"{{\"type\": \"text\", \"text\": ...}}, got {part!r:.80}",
                               f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(422, f"{where}.content must be a string or a list of text parts, got "
                            f"{_kind(content)}", f"{where}.content")
    # "developer" is OpenAI's newer name for the system turn; chat templates know "system"
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_prompt(prompt: Any, served: Served) -> list[int]:
    """The prompt tokens of a completions request: a string, or a list of token ids, or either
    alone in a list (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = prompt_ids(served.tokenizer, prompt, raw=True)[0].tolist() if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        bad = [t for t in prompt if not 0 <= t < served.vocab_size]
        if bad:
            raise APIError(422, f"prompt holds token id {bad[0]}, outside the vocabulary "
                                f"[0, {served.vocab_size})", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"prompt holds {len(prompt)} prompts: this server answers one prompt "
                            f"per request", "prompt", "unsupported_parameter")
    else:
        raise APIError(422, f"prompt must be a string or a list of token ids, got "
                            f"{_kind(prompt)}", "prompt")
    if not ids:
        raise APIError(422, "prompt must not be empty", "prompt")
    return ids


# ----------------------------------------------------------------------------- sampling fields


def _temperature(value: Any) -> float:
    if value is None:
        return 1.0  # OpenAI's default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise APIError(422, f"temperature must be a finite number >= 0, got {value!r}",
                       "temperature")
    return float(value)


def _seed(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise APIError(422, f"seed must be an integer in [0, 2**64), got {value!r}", "seed")
    return value


def _max_tokens(body: dict, prompt_len: int, room: int, default: int) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise APIError(422, f"{name} must be an integer >= 1, got {value!r}", name)
    if value > room:
        raise APIError(422, f"{name} {value} does not fit the model's context after the "
                            f"prompt's {prompt_len} tokens: at most {room} new tokens fit",
                       name, "context_length_exceeded")
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP \
            or not all(isinstance(s, str) and s for s in stops):
        raise APIError(422, f"stop must be a non-empty string or a list of up to {MAX_STOP} of "
                            f"them, got {value!r:.80}", "stop")
    return stops


def _refuse_unsupported(body: dict, kind: str, temperature: float) -> None:
    """400 for fields whose requested behaviour this engine does not have.

    top_p and top_k change the distribution only when sampling: at temperature 0 (greedy) any
    value gives the same tokens, so they are accepted there; at temperature > 0 only their
    no-op values (top_p 1, top_k 0 or -1) are, since dartree samples the target's full
    distribution (the one its speculative acceptance is lossless for)."""
    def refuse(name: str, why: str):
        raise APIError(400, f"{name}: {why}", name, "unsupported_parameter")

    for name in ("top_p", "top_k"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise APIError(422, f"{name} must be a number, got {value!r}", name)
        no_op = value == 1 if name == "top_p" else value in (0, -1)
        if temperature > 0 and not no_op:
            refuse(name, f"dartree samples the target's whole distribution at temperature > 0 "
                         f"(its lossless rule); {name} must be unset or "
                         f"{'1' if name == 'top_p' else '0'}, got {value!r} (at temperature 0 any "
                         f"value is accepted: it changes nothing)")
    for name, no_op in (("n", 1), ("best_of", 1)):
        if body.get(name) not in (None, no_op):
            refuse(name, f"one answer per request: {name} must be unset or 1, got {body[name]!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0):
            refuse(name, f"penalties change the target's distribution, which dartree samples "
                         f"as it is: {name} must be unset or 0, got {body[name]!r}")
    for name in ("logit_bias", "tools", "functions"):
        if body.get(name):
            refuse(name, f"not supported by this server; leave {name} unset")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        refuse("logprobs", "log-probabilities are not returned by this server; leave it unset")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        refuse("response_format", f"only plain text answers: response_format must be unset or "
                                  f"{{\"type\": \"text\"}}, got {fmt!r:.80}")
    if kind == "text":
        if body.get("echo"):
            refuse("echo", "the prompt is not echoed by this server; leave echo unset")
        if body.get("suffix"):
            refuse("suffix", "insertion (suffix) is not supported; leave it unset")


def _kind(value: Any) -> str:
    """A JSON value's kind, for messages: 'a string', 'an array', 'null' ..."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)

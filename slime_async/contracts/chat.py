"""The chat contract: how an OpenAI-style conversation becomes prompt token ids, and how a
completion's text becomes an assistant message. The engine's `/v1/chat/completions` and the
rollout's training gateway both render with `render_chat`, so the same messages give the same
ids on either side.

Owns: `render_chat` (the tokenizer's chat template through transformers' `apply_chat_template`,
`tools` passed to it; for a model without a tokenizer, the id codec's stand-in template:
each message's content encoded and concatenated, an assistant message closed by EOS),
`normalize_messages` (OpenAI message shapes checked and turned into what HF templates expect:
text parts joined, tool-call arguments as objects), `parse_tool_calls` (a completion's tool
calls in the Hermes/Qwen, Mistral or Llama 3.x format into OpenAI `tool_calls`), `tool_names`,
`request_tools` (a request's `tools` for the template), `request_template_kwargs` (its
`chat_template_kwargs`, e.g. Qwen3's thinking switch) and `ChatError` (bad input; the caller
answers 400). Pure functions; imports no component.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatError(ValueError):
    """A malformed conversation; the message names the problem (HTTP 400)."""


def has_chat_template(tokenizer: Any) -> bool:
    """True when `tokenizer` is an HF tokenizer with a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def take_images(messages: Any, placeholder: str | None) -> tuple[Any, list[str]]:
    """(`messages` with each image content part replaced by a text part holding
    `placeholder`, the images' URLs in order). OpenAI's `{"type": "image_url", "image_url":
    {"url": ...}}` and the bare `{"type": "image", "image": ...}`; with `placeholder` None (a
    model without images) an image part is refused."""
    if not isinstance(messages, list):
        return messages, []
    images: list[str] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            url = _image_url(p)
            if url is None:
                parts.append(p)
                continue
            if placeholder is None:
                raise ChatError(f"messages[{i}] has an image; this model takes text only")
            images.append(url)
            parts.append({"type": "text", "text": placeholder})
        out.append({**m, "content": parts})
    return out, images


def _image_url(part: Any) -> str | None:
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "image"):
        return None
    ref = part.get("image_url") if part["type"] == "image_url" else part.get("image")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ChatError("an image content part needs image_url.url (a data:image/...;base64, URI)")
    return url


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if (
                not isinstance(p, dict)
                or p.get("type") != "text"
                or not isinstance(p.get("text"), str)
            ):
                raise ChatError(
                    f"{where}: content parts must be {{'type': 'text', 'text': str}} (this "
                    "server takes text only)"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise ChatError(f"{where}: content must be a string, a list of text parts or null")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatError(f"{where}: tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"{where}.tool_calls[{j}] needs function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends a JSON string; HF templates expect an object
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ChatError(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        out.append(
            {
                "id": c.get("id") or f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


_SET_BY_US = ("conversation", "tools", "add_generation_prompt", "tokenize", "return_dict")
"""apply_chat_template's arguments that `render_chat` sets itself."""


def request_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """A chat request's `chat_template_kwargs` (SGLang's and vLLM's name): keyword arguments
    for the chat template, e.g. `{"enable_thinking": false}` (Qwen3's thinking switch); {} when
    absent."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise ChatError("chat_template_kwargs must be an object of keyword arguments")
    taken = sorted(set(kw) & set(_SET_BY_US))
    if taken:
        raise ChatError(f"chat_template_kwargs cannot set {taken}: the server sets them")
    return dict(kw)


def request_tools(body: dict[str, Any]) -> list[Any] | None:
    """The `tools` a chat request gives the template (None with `tool_choice: "none"`)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatError("tools must be a list of tool definitions")
    return None if body.get("tool_choice") == "none" else tools


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI `messages` checked and in the shape HF chat templates read."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _text(m.get("content"), where)
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    eos_id: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt ids of normalized `messages` (see the module docstring for the two templates);
    `template_kwargs` go to the chat template (`request_template_kwargs`)."""
    if has_chat_template(tokenizer):
        try:
            ids = tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                **(template_kwargs or {}),
            )
        except Exception as e:  # a template's own raise_exception (e.g. roles out of order)
            raise ChatError(f"the chat template refused the conversation: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if tools:
        raise ChatError("this model has no chat template, so it cannot be given tools")
    if template_kwargs:
        raise ChatError("this model has no chat template, so chat_template_kwargs cannot apply")
    out: list[int] = []
    for m in messages:
        try:
            out += [int(t) for t in tokenizer.encode(m["content"])] if m["content"] else []
        except ValueError as e:
            raise ChatError(f"{m['role']} message: {e}") from None
        if m["role"] == "assistant" and eos_id is not None:
            out.append(eos_id)
    return out


def tool_names(tools: Sequence[Any] | None) -> frozenset[str]:
    """The function names a request's `tools` define (OpenAI's `{"type": "function",
    "function": {"name": ...}}`; a bare `{"name": ...}` too)."""
    names = set()
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def parse_tool_calls(
    text: str, *, tools: Collection[str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """`(content, tool_calls)` of a completion in any of the supported families' formats:
    the calls become OpenAI tool calls (arguments as a JSON string) and are cut from the
    content. Text that holds no well-formed call is returned whole as the content.

    * Hermes/Qwen: `<tool_call>{"name", "arguments"}</tool_call>` blocks (anywhere);
    * Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers) or
      `name[ARGS]{...}` per call (v11 and later), after any content;
    * Llama 3.x: `<|python_tag|>` then `{"name", "parameters"}` objects separated by `;`.

    A completion decoded without its special tokens has lost the Mistral and Llama markers: a
    whole completion that is a JSON list of calls or `;`-separated call objects is read as
    calls too, but only when each call names one of `tools` (the request's function names), so
    a plain JSON answer is never taken for a call."""
    if "<tool_call>" in text:
        return _hermes_calls(text)
    for marker, parse in ((_MISTRAL, _mistral_calls), (_PYTHON_TAG, _json_calls)):
        at = text.find(marker)
        if at >= 0:
            calls = parse(text[at + len(marker) :])
            if calls:
                return text[:at].strip(), [
                    _openai_call(*c, mistral=marker == _MISTRAL) for c in calls
                ]
    body = text.strip()
    if tools and body[:1] in ("[", "{"):
        calls = _json_calls(body)
        if calls and all(name in tools for name, _ in calls):
            return "", [_openai_call(*c, mistral=body[0] == "[") for c in calls]
    return text, []


_MISTRAL, _MISTRAL_ARGS, _PYTHON_TAG = "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"
_Call = tuple[str, Any]
"""(function name, arguments as parsed)."""


def _call_of(obj: Any) -> _Call | None:
    """A `{"name", "arguments"|"parameters"}` object as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return (obj["name"], args) if isinstance(args, dict | str) else None


def _openai_call(name: str, args: Any, *, mistral: bool = False) -> dict[str, Any]:
    """OpenAI's tool call; Mistral's templates accept only 9-character alphanumeric ids."""
    call_id = uuid.uuid4().hex[:9] if mistral else f"call_{uuid.uuid4().hex[:24]}"
    return {
        "id": call_id,
        "type": "function",
        "function": {
            "name": name,
            "arguments": args if isinstance(args, str) else json.dumps(args),
        },
    }


def _hermes_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes/Qwen `<tool_call>` blocks; a block that is not a call stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            call = _call_of(json.loads(m.group(1)))
        except json.JSONDecodeError:
            continue
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(_openai_call(*call))
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def _json_calls(text: str) -> list[_Call]:
    """Calls of a text that is only JSON call objects (`;` or blanks between them) or one JSON
    list of them; [] when anything else is there."""
    dec, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls
        try:
            obj, at = dec.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        for item in obj if isinstance(obj, list) and not calls else [obj]:
            call = _call_of(item)
            if call is None:
                return []
            calls.append(call)


def _mistral_calls(text: str) -> list[_Call]:
    """What follows Mistral's first `[TOOL_CALLS]`: a JSON list (v3), or `name[ARGS]{...}` per
    call, each call after its own `[TOOL_CALLS]` (v11 and later)."""
    if _MISTRAL_ARGS not in text:
        return _json_calls(text)
    calls: list[_Call] = []
    for part in text.split(_MISTRAL):
        name, sep, args = part.partition(_MISTRAL_ARGS)
        try:
            parsed, end = json.JSONDecoder().raw_decode(args.strip())
        except json.JSONDecodeError:
            return []
        if not sep or not name.strip() or not isinstance(parsed, dict):
            return []
        if args.strip()[end:].strip():
            return []
        calls.append((name.strip(), parsed))
    return calls


class IdText:
    """The text of a model without a tokenizer: its token ids in decimal, space-separated (the
    embedded engine's stand-in codec; `render_chat` falls back to it).

    >>> IdText().decode([5, 17]), IdText().encode("5 17")
    ('5 17', [5, 17])
    """

    unparsable = "this model has no tokenizer: message text must be space-separated token ids"
    """The error for text that is not token ids (a subclass names its own fix)."""

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise ValueError(self.unparsable) from None

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(str(int(i)) for i in ids)


_SENTINEL = "\u2063slime-async-turn-end\u2063"


def render_after_last_assistant(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    eos_id: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The ids the template renders after the last assistant message's content: that turn's
    closing tokens, the later messages and the generation prompt. Found by rendering the
    conversation with that content replaced by a sentinel string and tokenizing the text after
    it (the template's treatment of the earlier turns, e.g. stripped think blocks, does not
    matter)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ChatError("the conversation has no assistant message")
    if not has_chat_template(tokenizer):
        out = [eos_id] if eos_id is not None else []
        return out + render_chat(
            tokenizer, messages[last + 1 :], eos_id=eos_id, template_kwargs=template_kwargs
        )
    marked = [dict(m) for m in messages]
    marked[last] = {"role": "assistant", "content": _SENTINEL}
    try:
        text = tokenizer.apply_chat_template(
            marked,
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:
        raise ChatError(f"the chat template refused the conversation: {e}") from None
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ChatError("the chat template dropped the last assistant message's content")
    return [int(t) for t in tokenizer.encode(text[at + len(_SENTINEL) :], add_special_tokens=False)]

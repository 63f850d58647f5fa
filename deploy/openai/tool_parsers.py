"""Tool-call parsers: the calls a model wrote in its own format, as OpenAI's ``tool_calls``.

Every parser is incremental (``feed`` each new piece of text, then ``finish``) and returns what
can be sent now as a ``ToolDelta``: content text, and ``delta.tool_calls`` entries shaped like
OpenAI's stream (a call opens with its ``index``, ``id``, ``type`` and ``function.name``, then
its ``function.arguments`` arrive in fragments). A whole response runs the same parser over the
whole text (``extract``), so a streamed answer and a whole one always agree.

A call's ``arguments`` are the JSON text the model wrote for them, sent as it arrives: the
parser scans the JSON itself (``json.JSONDecoder.raw_decode`` for each complete key and value;
``partial_json_parser`` tells an unfinished value from a malformed one), so a fragment is sent
as soon as it is known to belong to the arguments and nothing is ever taken back.

Formats (``--tool-call-parser``, vLLM's names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen);
  a block may also hold a JSON list of calls (SmolLM2's form). Text outside blocks is content.
- ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}`` (Llama 3.x), optionally
  after ``<|python_tag|>``, several calls separated by ``;``; an answer that starts otherwise is
  content.

Both accept ``arguments`` or ``parameters``. A call that is not valid JSON (or has no ``name``)
is returned as content, with the text after it. ``JsonArrayToolParser`` and ``NamedToolParser``
read the output that ``tool_choice`` ``required`` and a named function force with a grammar.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import partial_json_parser

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"
#: The keys a call's arguments may have (OpenAI's, Llama 3's).
ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    """A tool call's id in OpenAI's form (``call_`` + 24 hexadecimal digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass
class ToolDelta:
    """What a parser can send now: content text and ``delta.tool_calls`` entries (OpenAI's stream shape)."""

    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def merge(self, other: ToolDelta) -> ToolDelta:
        """This delta then ``other``, the fragments of one call joined into one entry."""
        merged = ToolDelta(
            self.content + other.content, [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        )
        for entry in other.tool_calls:
            _add_fragment(merged.tool_calls, entry)
        return merged


def _add_fragment(entries: list[dict], entry: dict) -> None:
    last = next((e for e in entries if e["index"] == entry["index"]), None)
    if last is None:
        entries.append(dict(entry, function=dict(entry["function"])))
    else:
        last["function"]["arguments"] = last["function"].get("arguments", "") + entry["function"].get("arguments", "")


class _Incomplete(Exception):
    """The text ends before the JSON value does."""


class _Malformed(Exception):
    """The text cannot be the start of the JSON expected there."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _value_end(text: str, start: int) -> int:
    """The end of the JSON value that starts at ``start`` (exclusive).

    Raises:
        _Incomplete: the text is a prefix of a value (a number at the very end may go on, too).
        _Malformed: the text cannot start a value.
    """
    try:
        _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        try:
            partial_json_parser.loads(text[start:])
        except Exception as exc:  # noqa: BLE001 - the library raises several kinds for malformed JSON
            raise _Malformed from exc
        raise _Incomplete from None
    if end == len(text) and text[start] in "-0123456789":
        raise _Incomplete
    return end


@dataclasses.dataclass
class _CallScan:
    """How far a call object ``{"name": ..., "arguments": {...}}`` has been written."""

    name: str | None = None  # once its string is complete
    args_start: int | None = None  # where the arguments' JSON starts in the text
    args_end: int | None = None  # where it ends, once complete
    end: int | None = None  # after the closing brace, once complete


def _scan_call(text: str, start: int) -> _CallScan:
    """Scan the call object at ``text[start] == "{"`` as far as the text goes.

    Raises:
        _Malformed: not such an object (not JSON, a non-string name, arguments not an object).
    """
    scan = _CallScan()
    i = start + 1
    first = True
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if not first:
            if text[i] != ",":
                raise _Malformed
            i = _skip_ws(text, i + 1)
            if i == len(text):
                return scan
        if text[i] != '"':
            raise _Malformed
        try:
            key_end = _value_end(text, i)
        except _Incomplete:
            return scan
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            raise _Malformed
        i = _skip_ws(text, i + 1)
        if i == len(text):
            return scan
        is_args = key in ARGUMENT_KEYS
        if is_args:
            if scan.args_start is not None or text[i] != "{":
                raise _Malformed
            scan.args_start = i
        try:
            end = _value_end(text, i)
        except _Incomplete:
            return scan
        if key == "name":
            name = json.loads(text[i:end])
            if not isinstance(name, str) or not name:
                raise _Malformed
            scan.name = name
        elif is_args:
            scan.args_end = end
        i, first = end, False


@dataclasses.dataclass
class _Call:
    index: int
    start: int  # where its object starts in the text
    id: str = ""
    args_sent: int = 0  # characters of its arguments sent


class ToolParser:
    """Base of the incremental parsers; a subclass moves through its format in ``_advance``.

    ``feed`` and ``finish`` return a ``ToolDelta``; ``calls`` counts the calls opened so far.
    """

    #: ``--tool-call-parser`` name (vLLM's).
    name = ""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text before it is handled
        self.calls: list[_Call] = []
        self.call: _Call | None = None  # the call being scanned
        self.fallback = 0  # where content resumes when the call being scanned turns out malformed
        self.given_up = False  # from ``pos`` on everything is content
        self._pending_ws = ""  # whitespace held back: content, unless a call follows it
        self._after_element = False  # in a list of calls: a call just ended (a comma or the end follows)
        self._delta = ToolDelta()

    # ---------------------------------------------------------------- public

    def feed(self, text: str) -> ToolDelta:
        """Take the next piece of the output; returns what can be sent now."""
        self.text += text
        self._run(final=False)
        return self._take()

    def finish(self) -> ToolDelta:
        """The output ended (or was cut): send what was held back."""
        self._run(final=True)
        if self.calls:
            self._pending_ws = ""
        else:
            self._delta.content += self._pending_ws
        return self._take()

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output: its content (``None`` when there are calls and nothing else) and its
        ``tool_calls`` (OpenAI's message shape)."""
        delta = self.feed(text).merge(self.finish())
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            }
            for c in delta.tool_calls
        ]
        content = delta.content
        return (content or None) if calls else content, calls

    @classmethod
    def prompt(cls, tools: list[dict]) -> str:
        """A system prompt that teaches a model whose chat template ignores ``tools`` this format."""
        raise NotImplementedError

    @classmethod
    def format_calls(cls, calls: list[dict]) -> str:
        """Earlier ``tool_calls`` (``{"name", "arguments"}`` each) written back in this format, for a chat
        template that does not render them."""
        raise NotImplementedError

    # ---------------------------------------------------------------- machinery

    def _run(self, final: bool) -> None:
        if self.given_up:
            self._content(self.text[self.pos :])
            self.pos = len(self.text)
            return
        self._advance(final)

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> ToolDelta:
        delta, self._delta = self._delta, ToolDelta()
        return delta

    def _content(self, text: str) -> None:
        """Content up to a possible call: its trailing whitespace waits to see whether a call follows."""
        body = text.rstrip(_WHITESPACE)
        if body:
            self._delta.content += self._pending_ws + body
            self._pending_ws = ""
        self._pending_ws += text[len(body) :]

    def _give_up(self) -> None:
        """The call being scanned is malformed: the text from ``fallback`` on is content."""
        if self.call is not None and self.call.id:
            self.pos = len(self.text)  # its opening was sent: it stays as far as it went
        else:
            self.pos = self.fallback
        self.call = None
        self.given_up = True
        self._run(final=False)

    def _open_call(self, start: int) -> None:
        self.call = _Call(len(self.calls), start)

    def _step_call(self, final: bool) -> bool:
        """Scan the open call; send its opening and new argument text. True once the call is done
        (``pos`` after it), False while it waits for text; a malformed call gives up."""
        call = self.call
        try:
            scan = _scan_call(self.text, call.start)
        except _Malformed:
            self._give_up()
            return False
        if scan.end is not None and scan.name is None:
            self._give_up()
            return False
        if scan.name is not None and not call.id:
            call.id = new_call_id()
            self.calls.append(call)
            self._pending_ws = ""
            self._send(call, {"name": scan.name, "arguments": ""}, opening=True)
        if call.id and scan.args_start is not None:
            stop = scan.args_end if scan.args_end is not None else len(self.text)
            fragment = self.text[scan.args_start + call.args_sent : stop]
            if fragment:
                call.args_sent += len(fragment)
                self._send(call, {"arguments": fragment})
        if scan.end is None:
            if final and not call.id:
                self._give_up()
            elif final:
                self.pos, self.call = len(self.text), None  # cut off: the call as far as it went
            return False
        if scan.args_start is None:
            self._send(call, {"arguments": "{}"})
        self.pos, self.call = scan.end, None
        return True

    def _send(self, call: _Call, function: dict, opening: bool = False) -> None:
        entry = {"index": call.index, "function": function}
        if opening:
            entry = {"index": call.index, "id": call.id, "type": "function", "function": function}
        _add_fragment(self._delta.tool_calls, entry)

    def _next_char(self, final: bool) -> int | None:
        """The index of the first non-space character from ``pos``; ``None`` while there is none (given up when
        ``final``: the output ended before the calls began)."""
        i = _skip_ws(self.text, self.pos)
        if i < len(self.text):
            return i
        if final:
            self._give_up()
        return None

    def _step_list(self, final: bool) -> str:
        """Inside a JSON list of calls (``pos`` after its ``[``): ``"done"`` after its ``]``, ``"wait"`` for
        more text, ``"bad"`` when malformed (given up)."""
        while True:
            if self.call is not None:
                if not self._step_call(final):
                    return "bad" if self.given_up else "wait"
                self.fallback, self._after_element = self.pos, True
            i = _skip_ws(self.text, self.pos)
            if i == len(self.text):
                return "wait"
            if self.text[i] == "]":
                self.pos, self._after_element = i + 1, False
                return "done"
            if self._after_element:
                if self.text[i] != ",":
                    self._give_up()
                    return "bad"
                self.pos, self._after_element = i + 1, False
                continue
            if self.text[i] != "{":
                self._give_up()
                return "bad"
            self._open_call(i)


def _listed(tools: list[dict]) -> str:
    """The tools' functions, one JSON line each (``strict`` left out: it is for the server, not the model)."""
    functions = [{k: v for k, v in tool["function"].items() if k != "strict"} for tool in tools]
    return "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)


def _tools_prompt(listed: str, how: str) -> str:
    """A format's system prompt: the functions (``listed``, in the format's wrapping), then ``how`` to call them."""
    return (
        "You can call functions to help answer. These are the functions, each as a JSON schema:\n"
        f"{listed}\n{how}"
        "The results come back in a message from the tool. If no function fits, answer in words."
    )


def _proper_prefix_at_end(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding a call object or a JSON list of them; content around them."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content | body | list | call | close

    def _advance(self, final: bool) -> None:
        while not self.given_up:
            if self.state == "content":
                found = self.text.find(self.OPEN, self.pos)
                if found < 0:
                    held = 0 if final else _proper_prefix_at_end(self.text[self.pos :], self.OPEN)
                    self._content(self.text[self.pos : len(self.text) - held])
                    self.pos = len(self.text) - held
                    return
                self._content(self.text[self.pos : found])
                self.fallback, self.pos, self.state = found, found + len(self.OPEN), "body"
            elif self.state == "body":
                i = self._next_char(final)
                if i is None:
                    return
                if self.text[i] == "[":
                    self.pos, self.state = i + 1, "list"
                elif self.text[i] == "{":
                    self._open_call(i)
                    self.state = "call"
                else:
                    self._give_up()
            elif self.state == "list":
                step = self._step_list(final)
                if step != "done":
                    return
                self.state = "close"
            elif self.state == "call":
                if not self._step_call(final):
                    return
                self.state = "close"
            else:  # after a block's calls: its closing tag, if the model wrote it
                i = _skip_ws(self.text, self.pos)
                rest = self.text[i:]
                if not final and len(rest) < len(self.CLOSE) and self.CLOSE.startswith(rest):
                    return
                if rest.startswith(self.CLOSE):
                    self.pos = i + len(self.CLOSE)
                self.state = "content"

    @classmethod
    def prompt(cls, tools: list[dict]) -> str:
        return _tools_prompt(
            f"<tools>\n{_listed(tools)}\n</tools>",
            "To call functions, reply with only a list of the calls, in this form:\n"
            '<tool_call>[{"name": "<function name>", "arguments": {<argument name>: <value>, ...}}]</tool_call>\n',
        )

    @classmethod
    def format_calls(cls, calls: list[dict]) -> str:
        return f"{cls.OPEN}{json.dumps(calls, ensure_ascii=False)}{cls.CLOSE}"


class Llama3JsonToolParser(ToolParser):
    """An answer that is ``{"name": ..., "parameters": {...}}`` (``;`` between calls), maybe after
    ``<|python_tag|>``; any other answer is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start | call | between

    def _advance(self, final: bool) -> None:
        while not self.given_up:
            if self.state == "start":
                i = _skip_ws(self.text, self.pos)
                rest = self.text[i:]
                if rest.startswith(self.PYTHON_TAG):
                    i = _skip_ws(self.text, i + len(self.PYTHON_TAG))
                    rest = self.text[i:]
                if not rest or (self.PYTHON_TAG.startswith(rest) and not final):
                    if final:
                        self._give_up()
                    return
                if rest[0] != "{":
                    self._give_up()
                    return
                self._open_call(i)
                self.state = "call"
            elif self.state == "call":
                if not self._step_call(final):
                    return
                self.fallback, self.state = self.pos, "between"
            else:
                i = _skip_ws(self.text, self.pos)
                if i == len(self.text):
                    return
                if self.text[i] != ";":
                    self._give_up()
                    return
                j = _skip_ws(self.text, i + 1)
                if j == len(self.text):
                    if final:
                        self.pos = j
                    return
                if self.text[j] != "{":
                    self._give_up()
                    return
                self._open_call(j)
                self.state = "call"

    @classmethod
    def prompt(cls, tools: list[dict]) -> str:
        return _tools_prompt(
            _listed(tools),
            "To call a function, reply with only a JSON object of this form:\n"
            '{"name": "<function name>", "parameters": {<argument name>: <value>, ...}}\n'
            "Several calls are separated by ;. ",
        )

    @classmethod
    def format_calls(cls, calls: list[dict]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls
        )


class JsonArrayToolParser(ToolParser):
    """The output ``tool_choice: "required"`` forces: a JSON list of ``{"name", "arguments"}`` objects."""

    name = "json_array"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"

    def _advance(self, final: bool) -> None:
        if self.state == "start":
            i = self._next_char(final)
            if i is None:
                return
            if self.text[i] != "[":
                self._give_up()
                return
            self.pos, self.state = i + 1, "list"
        if self.state == "list" and self._step_list(final) == "done":
            self.state = "done"
        if self.state == "done" and self.pos < len(self.text):
            self._content(self.text[self.pos :])
            self.pos = len(self.text)


class NamedToolParser(ToolParser):
    """The output a named ``tool_choice`` forces: the arguments of that one function."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def _advance(self, final: bool) -> None:
        if not self.calls:
            call = _Call(0, 0, new_call_id())
            self.calls.append(call)
            self._send(call, {"name": self.function_name, "arguments": ""}, opening=True)
        call = self.calls[0]
        fragment = self.text[call.args_sent :]
        if fragment:
            call.args_sent += len(fragment)
            self._send(call, {"arguments": fragment})


#: ``--tool-call-parser`` choices.
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
#: The parser of SmolLM2 (trained on ``<tool_call>[...]</tool_call>``) and of Hermes / Qwen models.
DEFAULT_TOOL_PARSER = "hermes"

"""Where the members of JSON objects begin and end, in JSON text that is still arriving.

A streamed tool call is sent piece by piece: its name once the name's string has closed, then its
arguments as their text grows. ``ObjectScanner`` reads the text a delta at a time (each character
once) and keeps, for every object at one nesting depth, the span of each member's value. It
tracks strings, escapes and brackets only: it does not check that the text is JSON (the whole
answer's parse decides that), so text around or between the objects (``;``, a closing tag) is
passed over.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass
class Span:
    start: int  # the value's first character
    end: int | None = None  # past its last character; None while the value is still open


@dataclasses.dataclass
class ScannedObject:
    start: int  # its "{"
    end: int | None = None  # past its "}"; None while open
    members: dict[str, Span] = dataclasses.field(default_factory=dict)


# what comes next at an object's member level
_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER_VALUE = range(5)


class ObjectScanner:
    """The objects at ``depth`` (1: top-level objects, one after another; 2: the objects of a
    top-level array), with their members' value spans, positions into ``text``. With
    ``max_objects`` it stops reading once that many objects have closed."""

    def __init__(self, depth: int = 1, max_objects: int | None = None):
        self.depth = depth
        self.max_objects = max_objects
        self.text = ""
        self.objects: list[ScannedObject] = []
        self._stack: list[str] = []
        self._in_string = self._escaped = False
        self._string_start = 0
        self._expect = _KEY
        self._key: str | None = None
        self._value: Span | None = None  # the member value being read
        self._scalar = False  # that value is a number, true, false or null
        self._closed = 0  # objects closed

    @property
    def done(self) -> bool:
        return self.max_objects is not None and self._closed >= self.max_objects

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        for i in range(start, len(self.text)):
            if self.done:
                return
            self._char(self.text[i], i)

    def value_text(self, span: Span) -> str:
        """A value's text so far (all of it once the span has closed)."""
        return self.text[span.start:span.end]

    def string_value(self, obj: ScannedObject, key: str) -> str | None:
        """The member ``key`` when it is a whole JSON string, decoded; else None."""
        span = obj.members.get(key)
        if span is None or span.end is None or self.text[span.start] != '"':
            return None
        try:
            return json.loads(self.text[span.start:span.end])
        except ValueError:
            return None

    def _at_members(self) -> bool:
        return (len(self._stack) == self.depth and self._stack[-1] == "{" and bool(self.objects)
                and self.objects[-1].end is None)

    def _open_value(self, i: int, scalar: bool = False) -> None:
        self._value = Span(i)
        self._scalar = scalar
        if self._key is not None:
            self.objects[-1].members[self._key] = self._value
        self._expect = _IN_VALUE

    def _close_value(self, end: int) -> None:
        self._value.end = end
        self._value, self._scalar = None, False
        self._expect = _AFTER_VALUE

    def _char(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                self._string_closed(i)
            return
        members = self._at_members()
        if members and self._scalar and (c in ",}]" or c.isspace()):
            self._close_value(i)
        if c == '"':
            self._in_string, self._string_start = True, i
            if members and self._expect == _VALUE:
                self._open_value(i)
        elif c in "{[":
            if members and self._expect == _VALUE:
                self._open_value(i)
            self._stack.append(c)
            if c == "{" and len(self._stack) == self.depth:
                self.objects.append(ScannedObject(i))
                self._expect, self._key = _KEY, None
        elif c in "}]":
            if not self._stack:
                return  # not JSON; the answer's parse will say so
            closes_object = members and c == "}"
            self._stack.pop()
            if closes_object:
                self.objects[-1].end = i + 1
                self._closed += 1
            elif self._value is not None and not self._scalar and self._at_members():
                self._close_value(i + 1)  # a member's object or array closed
        elif members:
            if c == ":" and self._expect == _COLON:
                self._expect = _VALUE
            elif c == ",":
                self._expect, self._key = _KEY, None
            elif not c.isspace() and self._expect == _VALUE:
                self._open_value(i, scalar=True)

    def _string_closed(self, i: int) -> None:
        if not self._at_members():
            return  # a string inside a member's value, or outside the objects
        if self._expect == _KEY:
            try:
                self._key = json.loads(self.text[self._string_start:i + 1])
            except ValueError:
                self._key = None
            self._expect = _COLON
        elif self._value is not None and not self._scalar:
            self._close_value(i + 1)

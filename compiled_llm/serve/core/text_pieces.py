"""A growing text kept as the pieces it was appended in, so that a 100k-token output costs
linear time.

``text += piece`` on an attribute copies the whole text every time (CPython extends a string in
place only when nothing else holds it, which an attribute defeats): a 100k-token output of 500k
characters copies ~2.5 * 10^10. Here an append only records the piece; the text is joined when someone reads it
whole (once, for a finished output), and the step loop's readers look at the tail alone: a stop
string search at the last characters, a stream's delta at the new ones.

Snapshots (``snapshot``) stand for the text as it was, read lazily: an output of a streamed
request carries one, and costs nothing unless its ``text`` is read. A piece list is only ever
appended to; anything that changes what is already there (``truncate``, ``replace``, joining
for ``value``) starts a new list, so older snapshots keep theirs.
"""

from __future__ import annotations


class TextPieces:
    def __init__(self, text: str = ""):
        self._pieces: list[str] = [text] if text else []
        self._length = len(text)
        self.chars_joined = 0  # characters copied into joined strings so far (the work test counts)

    def __len__(self) -> int:
        return self._length

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)

    def value(self) -> str:
        """The whole text (joined once; the pieces become that one string)."""
        if len(self._pieces) > 1:
            self._pieces = [self._join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def slice(self, start: int, end: int) -> str:
        """text[start:end] (0 <= start <= end <= len), reading only the pieces that hold it,
        found from the end: readers ask for ranges near the end."""
        if start >= end:
            return ""
        pieces = self._pieces
        i, pos = len(pieces) - 1, self._length - len(pieces[-1])
        if start >= pos:  # within the last piece
            return pieces[i][start - pos:end - pos]
        while pos > start:
            i -= 1
            pos -= len(pieces[i])
        parts = pieces[i:]
        parts[0] = parts[0][start - pos:]
        if end < self._length:
            cut = self._length - end
            while cut >= len(parts[-1]):
                cut -= len(parts.pop())
            if cut:
                parts[-1] = parts[-1][:-cut]
        return self._join(parts)

    def truncate(self, length: int) -> None:
        """Keep text[:length]."""
        if length >= self._length:
            return
        kept, pos = list(self._pieces), self._length
        while kept and pos - len(kept[-1]) >= length:
            pos -= len(kept.pop())
        if pos > length:
            kept[-1] = kept[-1][: len(kept[-1]) - (pos - length)]
        self._pieces, self._length = kept, length

    def replace(self, text: str) -> None:
        self._pieces, self._length = ([text] if text else []), len(text)

    def snapshot(self) -> "TextSnapshot":
        return TextSnapshot(self._pieces, len(self._pieces), self)

    def _join(self, parts: list[str]) -> str:
        out = "".join(parts)
        self.chars_joined += len(out)
        return out


class TextSnapshot:
    """The text of a ``TextPieces`` at one moment, joined when first read (``str(snapshot)``)."""

    __slots__ = ("_pieces", "_count", "_owner", "_text")

    def __init__(self, pieces: list[str], count: int, owner: TextPieces | None = None):
        self._pieces, self._count, self._owner, self._text = pieces, count, owner, None

    def __str__(self) -> str:
        if self._text is None:
            parts = self._pieces[: self._count]
            if len(parts) == 1:
                self._text = parts[0]
            elif self._owner is not None:
                self._text = self._owner._join(parts)
            else:
                self._text = "".join(parts)
            self._pieces = self._owner = None
        return self._text

    def __reduce__(self):
        return str, (str(self),)  # pickled as the plain string


class LazyText:
    """A dataclass field holding a ``str`` or a ``TextSnapshot``; reading it gives the str
    (a snapshot is joined on the first read, then kept). It has no default."""

    def __set_name__(self, owner, name: str) -> None:
        self._name = name

    def __get__(self, obj, objtype=None) -> str:
        if obj is None:
            raise AttributeError(self._name)  # dataclasses: the field has no default
        value = obj.__dict__[self._name]
        if not isinstance(value, str):
            value = obj.__dict__[self._name] = str(value)
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self._name] = value

"""Pickled messages both ways over two non-blocking pipes: the server's front end and its engine
process (``engine_core``) talk through one of these at each end.

Neither side may wait for the other. An engine process that waited for a busy event loop to read
its outputs would stop stepping; a front end that waited for a stepping engine to read its
submissions could deadlock with it, each blocked on a full pipe. So ``send`` appends to an
unbounded buffer and writes what the pipe takes now, ``flush`` writes more of it later (when the
pipe's end is writable again), and ``receive`` returns the whole messages that have arrived.
A message is a length (8 bytes, little-endian) and a pickle. Both ends are this package, and
the pipes are made by the front end for the one engine process it starts. A connected socket
works the same, as both descriptors at once (an engine core in a Ray actor, on any node:
``ray_replicas``); its front end reads nothing from it before the other end has proved to be the
engine it started.
"""

from __future__ import annotations

import array
import fcntl
import os
import pickle
import stat
import struct
import termios

_HEADER = struct.Struct("<Q")
_READ_SIZE = 1 << 20
# Linux lets a pipe hold up to /proc/sys/fs/pipe-max-size (1 MiB by default) instead of 64 KiB:
# a decode step's outputs for hundreds of streams then go in one write.
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_SIZE = 1 << 20


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
    except OSError:  # not Linux, or a lower limit: the default size works, in more writes
        pass


# The bytes written to a pipe and not yet read from it (FIONREAD counts them at either end)
_FIONREAD = getattr(termios, "FIONREAD", 0x541B)


def _counts_unread_bytes(fd: int) -> bool:
    """Whether the bytes written on ``fd`` that the other end has not read can be counted: on a
    pipe, yes. On a socket no: TCP's TIOCOUTQ counts what the peer's kernel has not
    acknowledged, and a Unix socket's counts buffer memory, not bytes."""
    return stat.S_ISFIFO(os.fstat(fd).st_mode)


class MessageChannel:
    """One end: reads messages from ``read_fd`` and writes them to ``write_fd`` (both set
    non-blocking; one socket's descriptor may be both). ``closed`` once the other end has gone
    (end of file, a broken pipe, a reset connection)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        _grow_pipe(write_fd)
        self._counts_unread = _counts_unread_bytes(write_fd)
        self._last_size = 0  # bytes of the last message sent (reader_behind)
        self._in = bytearray()
        self._out = bytearray()
        self.closed = False
        self._fds_closed = False

    @property
    def pending(self) -> bool:
        """Some sent bytes are still waiting for room in the pipe."""
        return bool(self._out)

    @property
    def reader_behind(self) -> bool:
        """The other end has not read a message sent before the last one: bytes of it still
        wait here or in the pipe. The last message alone unread is no sign of a slow reader (it
        may have been sent a moment ago). An engine holds back streamed tokens while its front
        ends are behind, and sends them merged once one has caught up (``EngineCore``). Always
        False where the unread bytes cannot be counted (a socket)."""
        if not self._counts_unread or self.closed:
            return False
        if len(self._out) > self._last_size:
            return True
        count = array.array("i", [0])
        try:
            fcntl.ioctl(self.write_fd, _FIONREAD, count, True)
        except OSError:
            return False
        return count[0] + len(self._out) > self._last_size

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._last_size = _HEADER.size + len(data)
        self._out += _HEADER.pack(len(data))
        self._out += data
        self.flush()

    def flush(self) -> bool:
        """Write what the pipe takes now; True when nothing is left waiting."""
        while self._out:
            try:
                n = os.write(self.write_fd, self._out)
            except BlockingIOError:
                return False
            except (BrokenPipeError, OSError):  # the other end has gone: nobody will read it
                self.closed = True
                self._out.clear()
                return True
            del self._out[:n]
        return True

    def receive(self) -> list:
        """Every whole message that has arrived, in order ([] when none)."""
        while True:
            try:
                chunk = os.read(self.read_fd, _READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self._in += chunk
        messages = []
        start, size = 0, len(self._in)
        view = memoryview(self._in)
        try:
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(view, start)
                end = start + _HEADER.size + length
                if end > size:
                    break
                messages.append(pickle.loads(view[start + _HEADER.size:end]))
                start = end
        finally:
            view.release()
        if start:
            del self._in[:start]
        return messages

    def close(self) -> None:
        """Close both ends once (a second call must not close a descriptor number that the
        process has since given to another file)."""
        if self._fds_closed:
            return
        self._fds_closed = True
        for fd in dict.fromkeys((self.read_fd, self.write_fd)):  # a socket is both: closed once
            try:
                os.close(fd)
            except OSError:
                pass
        self.closed = True

"""Keys typed while ``sluice chat`` streams a reply: kept out of the reply, given back after it.

Left alone, the terminal echoes keys the moment they are typed, into the middle of the reply's
text, and holds them in its line buffer for whatever reads next. While a reply streams, ``held``
turns the echo off and lets keys through one by one (the terminal's line editing off; Ctrl-C
still interrupts); once the reply has ended, it reads what was typed and puts the terminal back.
What was typed is then what a shell does with type-ahead: lines ended with Enter are sent next,
in order, and the line being typed waits at the next prompt, to edit or send.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import termios
from collections.abc import Iterator
from dataclasses import dataclass, field

# Cursor and function keys (ESC [ ... letter, ESC O letter): keys for editing a line, not text.
_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)?")
_ERASE_CHAR = ("\x7f", "\b")
_ERASE_LINE = "\x15"  # Ctrl-U
_ERASE_WORD = "\x17"  # Ctrl-W


@dataclass
class Typed:
    lines: list[str] = field(default_factory=list)  # ended with Enter: to send, in order
    partial: str = ""  # the line being typed: to show at the next prompt

    def add(self, raw: str) -> None:
        """``raw`` keys, applied as a terminal's line editing would apply them."""
        line = self.partial
        for key in _ESCAPES.sub("", raw):
            if key in "\r\n":
                if line.strip():
                    self.lines.append(line.strip())
                line = ""
            elif key in _ERASE_CHAR:
                line = line[:-1]
            elif key == _ERASE_LINE:
                line = ""
            elif key == _ERASE_WORD:
                line = line.rstrip()
                line = line[:line.rfind(" ") + 1]
            elif key >= " ":
                line += key
        self.partial = line


@contextlib.contextmanager
def held(fd: int, typed: Typed) -> Iterator[Typed]:
    """For the ``with`` body: keys on terminal ``fd`` not echoed; after it, what was typed added
    to ``typed`` (which may hold lines and a partial line typed before)."""
    try:
        before = termios.tcgetattr(fd)
    except termios.error:  # not a terminal after all
        yield typed
        return
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, keys readable one by one
    quiet[3] |= termios.ISIG  # Ctrl-C still interrupts the reply
    quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 1, 0
    with _no_sigint():
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield typed
    finally:
        # A Ctrl-C here waits until the terminal is as it was (then interrupts as usual): one
        # landing mid-way would leave it without echo.
        with _no_sigint():
            raw = b""
            with contextlib.suppress(OSError):
                while select.select([fd], [], [], 0)[0]:
                    chunk = os.read(fd, 4096)
                    if not chunk:
                        break
                    raw += chunk
            termios.tcsetattr(fd, termios.TCSANOW, before)
        typed.add(raw.decode(errors="ignore"))


@contextlib.contextmanager
def _no_sigint() -> Iterator[None]:
    """SIGINT held back (not lost) for the body: delivered, as a KeyboardInterrupt, right after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

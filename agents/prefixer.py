"""The `[rankN]:` prefix on each line of a worker's output, as the agent forwards it to the console (torchrun's
--tee style). Pure: bytes in, bytes out."""
from __future__ import annotations


class Prefixer:
    """Puts `prefix` at the start of each line of a byte stream that arrives in arbitrary chunks. Partial
    lines pass through at once (a `\\r` progress bar shows as it is drawn); a line that already starts with
    the prefix (torch's excepthook writes `[rankN]: ` before each traceback line) gets it only once.

    A carriage return starts a new line for the prefix (a progress bar's redraw is prefixed like a line), but a
    bare `\\r` at a line's start passes before the prefix, not after it: tqdm starts every redraw with `\\r`, and
    prefixing that `\\r` wrote `[rank0]:\\r[rank0]:  10%|...` (a stray `[rank0]:^M` in every log) instead of
    `\\r[rank0]:  10%|...`."""

    def __init__(self, prefix: bytes):
        self.prefix, self.at_start = prefix, True

    def feed(self, chunk: bytes) -> bytes:
        out = bytearray()
        for piece in chunk.splitlines(keepends=True):
            if piece == b"\r":           # a redraw begins: the prefix follows it, with the redrawn text
                out += piece
                self.at_start = True
                continue
            if self.at_start and not piece.startswith(self.prefix):
                out += self.prefix
            out += piece
            self.at_start = piece.endswith((b"\n", b"\r"))
        return bytes(out)

"""Read the pixels of a PNG screenshot (8-bit RGB or RGBA, not interlaced), stdlib only."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Image:
    def __init__(self, width: int, height: int, channels: int, rows: list[bytes]) -> None:
        self.width, self.height, self.channels, self.rows = width, height, channels, rows

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        at = x * self.channels
        return tuple(self.rows[y][at:at + 3])  # type: ignore[return-value]

    def count(self, colour: tuple[int, int, int], box: tuple[int, int, int, int],
              tolerance: int = 40) -> int:
        """Pixels within ``tolerance`` (per channel) of ``colour`` in box (x0, y0, x1, y1)."""
        x0, y0, x1, y1 = box
        found = 0
        for y in range(max(0, y0), min(self.height, y1)):
            for x in range(max(0, x0), min(self.width, x1)):
                pixel = self.pixel(x, y)
                if all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True)):
                    found += 1
        return found


def read_png(path: Path) -> Image:
    data = path.read_bytes()
    assert data.startswith(SIGNATURE), "not a PNG"
    pos, idat = len(SIGNATURE), []
    width = height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and not interlace, "unsupported PNG"
            channels = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        _unfilter(kind, line, previous, channels)
        rows.append(bytes(line))
        previous = line
    return Image(width, height, channels, rows)


def _unfilter(kind: int, line: bytearray, previous: bytearray, bpp: int) -> None:
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up = previous[i]
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            corner = previous[i - bpp] if i >= bpp else 0
            guess = left + up - corner
            pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
            best = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            line[i] = (line[i] + best) & 0xFF

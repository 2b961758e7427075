"""The placed client's two ends: a publisher that writes numbered messages, a subscriber that
checks them (``linkcost``: QoS 0 over the mesh link; ``appendcost``: QoS 1 through the log).

Payloads are 64 bytes carrying (publisher index, magic, sequence), like the C load generator's.
A subscriber counts what arrives in order and what is missing, duplicated or foreign. At QoS 1
the subscriber acknowledges every PUBLISH, and the publisher numbers its publishes with packet
ids, keeps a flag per id outstanding and reads the PUBACKs: one for an id not outstanding, or
with an error reason code, is counted, and every publish must be acknowledged by the end.

Both ends are fed and drained by the caller's loop (non-blocking sockets): ``feed(data)`` with
what the socket gave, ``flush()`` / ``flush_acks()`` to write what is pending.
"""

from __future__ import annotations

import socket
import struct

from meshbench.placed import publish_packet, read_varint

MAGIC = 0x4D514C47  # "MQLG", as bench/loadgen.c
PROBE = 0x50524F42  # "PROB": a probe message, not counted
PAYLOAD = struct.Struct("<IIQ")  # publisher index, magic, sequence (native order, as loadgen)
SIZE = 64
PUBACK_HEAD = b"\x40\x02"  # PUBACK, remaining length 2: success with no properties (5.0 too)
PACKET_IDS = 65535


class Subscriber:
    __slots__ = ("acks", "buf", "dups", "foreign", "gaps", "index", "next_seq", "probed",
                 "received", "sock", "worker")

    def __init__(self, index: int, sock: socket.socket, worker: int | None) -> None:
        self.index = index
        self.sock = sock
        self.worker = worker
        self.buf = b""
        self.acks = bytearray()  # PUBACKs not written yet
        self.next_seq = 0
        self.received = 0  # valid messages
        self.dups = self.gaps = self.foreign = 0
        self.probed = False

    def feed(self, data: bytes) -> None:
        """Parse every complete PUBLISH, check its sequence and queue its PUBACK (QoS 1)."""
        buf = self.buf + data if self.buf else data
        size = len(buf)
        pos = 0
        unpack = PAYLOAD.unpack_from
        index = self.index
        while size - pos >= 2:
            length, mult, at = 0, 1, pos + 1
            while at < size:
                byte = buf[at]
                at += 1
                length += (byte & 0x7F) * mult
                mult *= 128
                if byte < 0x80:
                    break
            else:
                break
            end = at + length
            if end > size:
                break
            first = buf[pos]
            pos = end
            if first >> 4 != 3:
                continue  # SUBACK and the like
            at += 2 + (buf[at] << 8 | buf[at + 1])
            if first & 0x06:
                # MQTT-4.3.2-4: a PUBACK with the PUBLISH's packet id (we subscribe at QoS 1
                # at most, so never a QoS 2 delivery)
                self.acks += PUBACK_HEAD
                self.acks += buf[at:at + 2]
                at += 2
            plen = buf[at]  # the property length: one byte unless 128 or more
            if plen < 0x80:
                at += 1 + plen
            else:
                plen, at = read_varint(buf, at)
                at += plen
            if end - at < PAYLOAD.size:
                self.foreign += 1
                continue
            pub, magic, seq = unpack(buf, at)
            if magic == PROBE and pub == index:
                self.probed = True
            elif magic != MAGIC or pub != index:
                self.foreign += 1
            elif seq == self.next_seq:
                self.next_seq = seq + 1
                self.received += 1
            elif seq < self.next_seq:
                self.dups += 1
            else:
                self.gaps += seq - self.next_seq
                self.next_seq = seq + 1
                self.received += 1
        self.buf = buf[pos:]

    def flush_acks(self) -> None:
        """Write the PUBACKs queued so far (what the socket does not take stays queued)."""
        try:
            sent = self.sock.send(self.acks)
        except BlockingIOError:
            return
        del self.acks[:sent]


class Publisher:
    __slots__ = ("acked", "frame", "generated", "id_at", "inbuf", "index", "other", "out",
                 "outstanding", "qos", "refused", "sent", "seq_at", "sock", "unexpected",
                 "worker")

    def __init__(self, index: int, sock: socket.socket, worker: int | None, topic: str,
                 qos: int = 0) -> None:
        self.index = index
        self.sock = sock
        self.worker = worker
        self.qos = qos
        payload = PAYLOAD.pack(index, MAGIC, 0) + bytes(SIZE - PAYLOAD.size)
        self.frame = publish_packet(topic, payload, qos, 1 if qos else 0)
        self.seq_at = len(self.frame) - SIZE + 8
        self.id_at = len(self.frame) - SIZE - 3  # packet id, then the property length byte
        self.generated = 0  # numbered messages
        self.sent = 0  # QoS 1 publishes given a packet id (probes included)
        self.acked = self.refused = self.unexpected = self.other = 0
        self.outstanding = bytearray(PACKET_IDS + 1)  # 1: that packet id awaits its PUBACK
        self.inbuf = b""
        self.out = memoryview(b"")

    def in_flight(self) -> int:
        """QoS 1 publishes not acknowledged yet."""
        return self.sent - self.acked

    def _next_id(self) -> int:
        packet_id = self.sent % PACKET_IDS + 1
        self.outstanding[packet_id] = 1
        self.sent += 1
        return packet_id

    def probe(self) -> None:
        payload = PAYLOAD.pack(self.index, PROBE, 0) + bytes(SIZE - PAYLOAD.size)
        frame = bytearray(self.frame[:len(self.frame) - SIZE] + payload)
        if self.qos:
            struct.pack_into(">H", frame, self.id_at, self._next_id())
        self.sock.setblocking(True)
        self.sock.sendall(frame)
        self.sock.setblocking(False)

    def refill(self, count: int) -> None:
        frame, step, seq_at = self.frame, len(self.frame), self.seq_at
        chunk = bytearray(frame * count)
        pack = struct.Struct("<Q").pack_into
        seq = self.generated
        for offset in range(seq_at, seq_at + step * count, step):
            pack(chunk, offset, seq)
            seq += 1
        if self.qos:
            pack_id, next_id = struct.Struct(">H").pack_into, self._next_id
            for offset in range(self.id_at, self.id_at + step * count, step):
                pack_id(chunk, offset, next_id())
        self.generated = seq
        self.out = memoryview(chunk)

    def flush(self) -> bool:
        """Write what is pending; True when all of it went."""
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except BlockingIOError:
                return False
            self.out = self.out[sent:]
        return True

    def feed(self, data: bytes) -> None:
        """Count the PUBACKs in ``data``: each must be for an outstanding packet id, with a
        success reason code (absent, or below 0x80)."""
        buf = self.inbuf + data if self.inbuf else data
        size, pos = len(buf), 0
        while size - pos >= 2:
            length, at = buf[pos + 1], pos + 2
            if length >= 0x80:  # a PUBACK's length is one byte; anything else is counted
                try:
                    length, at = read_varint(buf, pos + 1)
                except ValueError:
                    break
            end = at + length
            if end > size:
                break
            first = buf[pos]
            pos = end
            if first >> 4 != 4 or length < 2:
                self.other += 1  # e.g. a DISCONNECT
                continue
            packet_id = buf[at] << 8 | buf[at + 1]
            if length > 2 and buf[at + 2] >= 0x80:
                self.refused += 1
            if self.outstanding[packet_id]:
                self.outstanding[packet_id] = 0
                self.acked += 1
            else:
                self.unexpected += 1
        self.inbuf = buf[pos:]

    def problems(self) -> list[str]:
        """What went wrong with this publisher's acknowledgements (QoS 1)."""
        found = []
        if self.in_flight():
            found.append(f"publisher {self.index}: {self.in_flight()} publishes unacknowledged")
        if self.refused:
            found.append(f"publisher {self.index}: {self.refused} PUBACKs with an error code")
        if self.unexpected:
            found.append(f"publisher {self.index}: {self.unexpected} PUBACKs for no publish")
        if self.other:
            found.append(f"publisher {self.index}: {self.other} packets other than PUBACK")
        return found

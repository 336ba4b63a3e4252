"""handlers/worker_socket.py: the worker socket's writes never interleave.

Through TorchServe the demo model's frames are small (a token chunk is ~60 bytes, a final reply
~1 KB) and the race stays invisible; here four writers send 1.5 MB frames, the size at which
0.12's unlocked writes were measured to corrupt
(docs/serving.md §The 0.12 async-mode bugs and their workarounds).
"""

from __future__ import annotations

import socket
import struct
import threading

from ts.service import Service

from handlers.worker_socket import LockedSocket, lock_worker_socket

FRAME_BYTES = 1_500_000
FRAMES_PER_WRITER = 6
WRITERS = 4


def frame(writer: int, n: int) -> bytes:
    return struct.pack("!ii", writer, n) + bytes([writer * 16 + n]) * FRAME_BYTES


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        assert piece, "the writer side closed early"
        data += piece
    return bytes(data)


def test_concurrent_big_frames_arrive_whole():
    reader, writer = socket.socketpair()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # partial sends, often
    locked = LockedSocket(writer)

    def send_frames(w: int) -> None:
        for n in range(FRAMES_PER_WRITER):
            locked.sendall(frame(w, n))

    threads = [threading.Thread(target=send_frames, args=(w,)) for w in range(WRITERS)]
    for thread in threads:
        thread.start()
    seen = []
    for _ in range(WRITERS * FRAMES_PER_WRITER):
        w, n = struct.unpack("!ii", read_exactly(reader, 8))
        body = read_exactly(reader, FRAME_BYTES)
        assert body == bytes([w * 16 + n]) * FRAME_BYTES, f"frame {w}/{n} interleaved"
        seen.append((w, n))
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(seen) == [(w, n) for w in range(WRITERS) for n in range(FRAMES_PER_WRITER)]
    reader.close(), writer.close()


def test_the_service_gets_the_locked_socket():
    lock_worker_socket()
    lock_worker_socket()  # idempotent: one wrapper, not two
    reader, writer = socket.socketpair()
    service = Service.__new__(Service)
    service.set_cl_socket(writer)
    assert isinstance(service.cl_socket, LockedSocket)
    assert not isinstance(service.cl_socket._sock, LockedSocket)
    service.cl_socket.sendall(b"ping")
    assert reader.recv(4) == b"ping"
    reader.close(), writer.close()

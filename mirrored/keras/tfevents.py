"""TensorBoard event files: the scalars ``keras.callbacks.TensorBoard`` logs, in TensorFlow's format.

What: ``EventFileWriter(logdir).scalar(tag, value, step)`` appends one ``Event`` holding one
scalar to ``<logdir>/events.out.tfevents.<time>.<host>.<pid>.<n>.v2``, the file TensorBoard
reads (``tensorboard --logdir logs``). The callback in callbacks.py writes ``epoch_loss``,
``epoch_accuracy``, ... per epoch under ``<log_dir>/train`` and ``<log_dir>/validation``, as
Keras 3's does.

Why by hand: the format is small and fixed, and TensorFlow is not a dependency here.
- A file is a sequence of TFRecords: ``uint64 length`` (little-endian),
  ``uint32 masked_crc32c(length bytes)``, ``length`` bytes of data,
  ``uint32 masked_crc32c(data)``. CRC-32C is the Castagnoli polynomial (``CRC32C_POLY``);
  "masked" rotates it right by 15 bits and adds ``CRC_MASK_DELTA``, as TFRecord does.
- Each record is a protocol-buffer ``Event``: wall_time (field 1, double), step (field 2,
  varint), and either file_version (field 3, the first record: "brain.Event:2") or a
  ``Summary`` (field 5) holding ``Value {tag (1), simple_value (2, float)}``.

Neighbours: callbacks.py (the TensorBoard callback); tests/test_tf_pages.py reads a file back
with its own bit-by-bit CRC and protobuf decoder.
"""
import os
import socket
import struct
import time

CRC32C_POLY = 0x82F63B78        # Castagnoli, reflected: the CRC TFRecord uses
CRC_MASK_DELTA = 0xA282EAD8     # TFRecord's mask: a CRC of CRC-bearing data stays distinctive
FILE_VERSION = b"brain.Event:2"


def _crc_table():
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data):
    """CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``), a byte at a time."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + CRC_MASK_DELTA) & 0xFFFFFFFF


def record(data):
    """One TFRecord around ``data``."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


def _varint(n):
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, wire_type, payload):
    key = _varint(number << 3 | wire_type)
    if wire_type == 2:                                       # length-delimited
        return key + _varint(len(payload)) + payload
    return key + payload


def event(wall_time, step, file_version=None, scalar=None):
    """An ``Event`` protobuf: ``scalar`` is ``(tag, value)``."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _field(3, 2, file_version)
    if scalar is not None:
        tag, value = scalar
        summary_value = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
        out += _field(5, 2, _field(1, 2, summary_value))
    return out


class EventFileWriter:
    """Appends scalar events to one new event file in ``logdir`` (created if missing)."""

    _count = 0

    def __init__(self, logdir):
        os.makedirs(logdir, exist_ok=True)
        EventFileWriter._count += 1
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
                f"{os.getpid()}.{EventFileWriter._count}.v2")
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")
        self._write(event(time.time(), 0, file_version=FILE_VERSION))

    def _write(self, data):
        self._file.write(record(data))
        self._file.flush()                  # a run cut short keeps the epochs it logged

    def scalar(self, tag, value, step):
        self._write(event(time.time(), int(step), scalar=(tag, float(value))))

    def close(self):
        self._file.close()

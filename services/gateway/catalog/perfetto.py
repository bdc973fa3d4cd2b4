"""A Perfetto trace (`.pftrace`, protobuf `perfetto.protos.Trace`) of a session's timeline.

Only the few messages a track-event timeline needs, encoded by hand (proto2 wire format):
  Trace            { repeated TracePacket packet = 1; }
  TracePacket      { uint64 timestamp = 8; uint32 trusted_packet_sequence_id = 10;
                     TrackEvent track_event = 11; TrackDescriptor track_descriptor = 60; }
  TrackDescriptor  { uint64 uuid = 1; string name = 2; uint64 parent_uuid = 5; }
  TrackEvent       { repeated DebugAnnotation debug_annotations = 4; Type type = 9;
                     uint64 track_uuid = 11; repeated string categories = 22; string name = 23; }
                     (Type: SLICE_BEGIN = 1, SLICE_END = 2, INSTANT = 3)
  DebugAnnotation  { int64 int_value = 4; string string_value = 6; string name = 10; }
One track per training run / sampler under one parent track for the session (plus lanes where its
requests overlap); each request is a slice from its acceptance to its last event, annotated with
its ids and token counts.
"""

from __future__ import annotations

import hashlib

from services.gateway.catalog.metering import Slice

SEQUENCE_ID = 1
SLICE_BEGIN, SLICE_END, INSTANT = 1, 2, 3


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _str_field(number: int, text: str) -> bytes:
    return _bytes_field(number, text.encode())


def track_uuid(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1


def _packet(body: bytes, timestamp: int | None = None) -> bytes:
    head = _int_field(8, timestamp) if timestamp is not None else b""
    return _bytes_field(1, head + _int_field(10, SEQUENCE_ID) + body)


def _descriptor(uuid: int, name: str, parent: int | None) -> bytes:
    body = _int_field(1, uuid) + _str_field(2, name) + (_int_field(5, parent) if parent is not None else b"")
    return _packet(_bytes_field(60, body))


def _annotation(name: str, value: str | int) -> bytes:
    payload = _int_field(4, value) if isinstance(value, int) else _str_field(6, value)
    return _bytes_field(4, _str_field(10, name) + payload)


def _event(kind: int, track: int, name: str | None, annotations: dict[str, str | int], ts: int) -> bytes:
    body = b"".join(_annotation(k, v) for k, v in annotations.items())
    body += _int_field(9, kind) + _int_field(11, track) + _str_field(22, "tinkerd")
    if name is not None:
        body += _str_field(23, name)
    return _packet(_bytes_field(11, body), ts)


def encode(session_id: str, slices: list[Slice]) -> bytes:
    """The whole trace file.

    Slices on one track must nest, but a run's requests overlap (the SDK pipelines them), so each
    run gets lanes: a slice goes on the first lane of its run that is free by its start; lane 0 is
    the run's own track, lane k a child track named `<run> · k`.
    """
    root = track_uuid(session_id)
    out = [_descriptor(root, f"session {session_id}", None)]
    lanes: dict[str, list[tuple[int, int]]] = {}  # run -> [(lane uuid, end of its last slice)]
    events = []
    for item in sorted(slices, key=lambda s: (s.start_ns, s.end_ns)):
        if item.track not in lanes:
            uuid = track_uuid(f"{session_id}/{item.track}")
            lanes[item.track] = []
            out.append(_descriptor(uuid, item.track, root))
        run = lanes[item.track]
        lane = next((i for i, (_, end) in enumerate(run) if end <= item.start_ns), None)
        if lane is None:
            lane = len(run)
            uuid = track_uuid(f"{session_id}/{item.track}/{lane}") if lane else track_uuid(f"{session_id}/{item.track}")
            if lane:
                out.append(_descriptor(uuid, f"{item.track} · {lane}", run[0][0]))
            run.append((uuid, item.end_ns))
        uuid = run[lane][0]
        run[lane] = (uuid, max(item.end_ns, item.start_ns + 1))
        if item.end_ns <= item.start_ns:
            events.append(_event(INSTANT, uuid, item.name, item.args, item.start_ns))
        else:
            events.append(_event(SLICE_BEGIN, uuid, item.name, item.args, item.start_ns))
            events.append(_event(SLICE_END, uuid, None, {}, item.end_ns))
    return b"".join(out + events)


# --- reading it back (tests, and `tinkerd` users checking a file) ------------------------------

def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, varint value or length-delimited bytes) of one message, in order."""
    pos, found = 0, list[tuple[int, int | bytes]]()
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            found.append((number, value))
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            found.append((number, data[pos : pos + length]))
            pos += length
        else:
            raise ValueError(f"unexpected wire type {wire} for field {number}")
    return found

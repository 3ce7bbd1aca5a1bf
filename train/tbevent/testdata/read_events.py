#!/usr/bin/env python3
"""Independent reader of TensorBoard event files, written from the documented
formats only (TFRecord framing: tensorflow/core/lib/io/record_writer.cc,
masked CRC-32C: tensorflow/core/lib/hash/crc32c.h; Event/Summary protos:
tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto).
It shares no code with the Go writer: its CRC-32C is a bitwise loop over the
reflected Castagnoli polynomial 0x82F63B78 and its protobuf decoder is hand
written. Prints one JSON line per event; exits non-zero on any mismatch.

    python3 read_events.py FILE
"""
import json, math, struct, sys

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF

def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

def varint(b, i):
    shift = val = 0
    while True:
        x = b[i]; i += 1
        val |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return val, i

def fields(b):
    i = 0
    while i < len(b):
        key, i = varint(b, i)
        num, typ = key >> 3, key & 7
        if typ == 0:
            v, i = varint(b, i)
        elif typ == 1:
            v = b[i:i + 8]; i += 8
        elif typ == 5:
            v = b[i:i + 4]; i += 4
        elif typ == 2:
            n, i = varint(b, i)
            v = b[i:i + n]; i += n
        else:
            raise ValueError("wire type %d" % typ)
        yield num, typ, v

assert crc32c(b"123456789") == 0xE3069283, "crc32c check value"
data = open(sys.argv[1], "rb").read()
off = 0
while off < len(data):
    hdr = data[off:off + 8]
    (n,) = struct.unpack("<Q", hdr)
    (hc,) = struct.unpack("<I", data[off + 8:off + 12])
    if hc != masked(hdr):
        sys.exit("length crc mismatch at %d" % off)
    body = data[off + 12:off + 12 + n]
    (dc,) = struct.unpack("<I", data[off + 12 + n:off + 16 + n])
    if dc != masked(body):
        sys.exit("data crc mismatch at %d" % off)
    ev = {"scalars": {}}
    for num, typ, v in fields(body):
        if num == 1 and typ == 1:
            ev["wall_time"] = struct.unpack("<d", v)[0]
        elif num == 2 and typ == 0:
            ev["step"] = v
        elif num == 3 and typ == 2:
            ev["file_version"] = v.decode()
        elif num == 5 and typ == 2:
            for n2, t2, val in fields(v):
                if n2 == 1 and t2 == 2:
                    tag, x = None, None
                    for n3, t3, w in fields(val):
                        if n3 == 1 and t3 == 2:
                            tag = w.decode()
                        elif n3 == 2 and t3 == 5:
                            x = struct.unpack("<f", w)[0]
                    ev["scalars"][tag] = x
    # Non-finite values as strings ("inf", "nan"): JSON has no literal for them.
    ev["scalars"] = {k: x if x is None or math.isfinite(x) else repr(x) for k, x in ev["scalars"].items()}
    print(json.dumps(ev))
    off += 16 + n

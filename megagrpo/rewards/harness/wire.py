"""Frames and plain data, shared by the trainer, the trusted test interpreter and the solution.

A frame is a 4-byte big-endian length, then that many bytes of JSON. A value crossing between
the solution and the tests is plain data only: None, bool, int, float, str, bytes, list, tuple,
dict, set, frozenset, nested. JSON carries None, bool, int, float (NaN and infinities as JSON's
NaN/Infinity) and str as themselves and a list as an array; the others are one-key objects:
{"t": [...]} tuple, {"s": [...]} set, {"f": [...]} frozenset, {"b": "<hex>"} bytes and
{"d": [[key, value], ...]} dict. `decode` rebuilds fresh built-in objects and refuses anything
else, so nothing the sender made can reach the receiver's comparisons.
"""
import json
import struct

MAX_DEPTH = 64


class NotPlainData(ValueError):
    """A value (to send) or an encoding (received) that is not plain data."""


class FrameError(ValueError):
    """A frame over the size limit or not JSON: the channel can no longer be trusted to be in step."""


def encode(value, depth: int = 0):
    """`value` as JSON-ready data; NotPlainData names the first part that is not plain data."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is set:
        return {"s": [encode(v, depth + 1) for v in value]}
    if kind is frozenset:
        return {"f": [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise NotPlainData(f"a {kind.__name__} is not plain data")


def decode(data, depth: int = 0):
    """Fresh built-in objects from `encode`'s output; NotPlainData for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return kind(data) if data is not None else None
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise NotPlainData(f"unknown encoding {str(data)[:60]!r}")
    (tag, body), = data.items()
    try:
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is not list:
            raise NotPlainData(f"tag {tag!r} needs a list")
        if tag == "t":
            return tuple(decode(v, depth + 1) for v in body)
        if tag in ("s", "f"):
            items = [decode(v, depth + 1) for v in body]
            return set(items) if tag == "s" else frozenset(items)
        if tag == "d":
            if not all(type(pair) is list and len(pair) == 2 for pair in body):
                raise NotPlainData("a dict is a list of [key, value] pairs")
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    except (TypeError, ValueError) as e:  # unhashable keys or set items, bad hex
        raise NotPlainData(f"{type(e).__name__}: {e}") from None
    raise NotPlainData(f"unknown tag {str(tag)[:20]!r}")


def dumps(obj, max_bytes: int) -> bytes:
    """One frame holding obj; FrameError when it is larger than max_bytes."""
    try:
        body = json.dumps(obj, separators=(",", ":")).encode()
    except (ValueError, TypeError, RecursionError) as e:
        raise FrameError(f"cannot serialise: {type(e).__name__}: {e}"[:200]) from None
    if len(body) > max_bytes:
        raise FrameError(f"a message of {len(body)} bytes is over the limit of {max_bytes}")
    return struct.pack(">I", len(body)) + body


def loads(body: bytes):
    """The JSON of a frame's body; FrameError when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise FrameError(f"not a JSON message: {type(e).__name__}: {e}"[:200]) from None


def send_frame(sock, obj, max_bytes: int) -> None:
    sock.sendall(dumps(obj, max_bytes))


def _recv_exactly(sock, n: int):
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock, max_bytes: int):
    """The next frame's JSON, or None at the end of the stream; FrameError when it is over the
    limit (its body is not read) or not JSON."""
    header = _recv_exactly(sock, 4)
    if header is None:
        return None
    (length,) = struct.unpack(">I", header)
    if length > max_bytes:
        raise FrameError(f"a message of {length} bytes is over the limit of {max_bytes}")
    body = _recv_exactly(sock, length)
    if body is None:
        return None
    return loads(body)

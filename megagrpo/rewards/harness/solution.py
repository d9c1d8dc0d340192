"""The solution interpreter: runs the model's code (read from stdin), then answers the trusted
side's calls on its socket (argv[1]) with plain data.

Nothing here is trusted: the model's code runs in this interpreter and may replace any of it.
It can only change the answers it gives; the tests, the counting, the timing and the report
live in another process it cannot reach.
"""
import socket
import sys

import wire


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    message_bytes = int(sys.argv[2])
    code = sys.stdin.read()
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as e:
        wire.send_frame(channel, {"init_error": _describe(e)}, message_bytes)
        raise
    names = [name for name, value in list(namespace.items()) if callable(value) and not name.startswith("__")]
    wire.send_frame(channel, {"names": names}, message_bytes)
    while True:
        request = wire.recv_frame(channel, message_bytes)
        if request is None:
            return
        name, args, kwargs = wire.decode(request["call"])
        try:
            value = namespace[name](*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the tests
            reply = {"raised": [type(e).__name__, _describe(e, with_type=False)]}
        else:
            try:
                reply = {"value": wire.encode(value)}
                wire.dumps(reply, message_bytes)
            except (wire.NotPlainData, wire.FrameError) as e:
                reply = {"not_plain": str(e)}
        reply["id"] = request["id"]
        wire.send_frame(channel, reply, message_bytes)


def _describe(e: BaseException, with_type: bool = True) -> str:
    try:
        text = str(e)
    except BaseException:  # noqa: BLE001
        text = "(no message)"
    return (f"{type(e).__name__}: {text}" if with_type else text)[:300]


if __name__ == "__main__":
    main()

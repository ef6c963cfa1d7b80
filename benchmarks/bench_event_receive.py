"""What receiving one small message costs a gathering receiver process, ZeroMQ vs plain TCP.

The central KV manager's receiver wakes at most every ``--gather-ms``, reads
every message waiting and goes back to sleep. This isolates the cost of the
receiving itself (no handler, no Ray): ``--senders`` connections in another
process send ``--size``-byte messages at ``--rate`` each per second, and the
receiver process's CPU time (all its threads: for ZeroMQ the I/O thread too)
is divided by the messages it read. Run at two rates to separate the
per-message cost from the fixed cost of the wake-ups:

    python benchmarks/bench_event_receive.py --rates 1 14 28

``zmq``: a ROUTER socket, DEALER senders (the transport of workers/kv_events/wire.py);
``tcp``: length-prefixed frames on plain sockets, read by the gathering
thread through a selector (no I/O thread).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import selectors
import socket
import struct
import threading
import time

_LENGTH = struct.Struct("<I")


def _process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _paced(num: int, rate: float, stop, send) -> None:
    """Call ``send(i)`` for connection i at ``rate`` per second each, staggered."""
    due = [time.perf_counter() + i / (num * rate) for i in range(num)]
    while not stop.is_set():
        i = min(range(num), key=due.__getitem__)
        wait = due[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        send(i)
        due[i] += 1 / rate


def _send_zmq(address: str, args, stop) -> None:
    import zmq

    context = zmq.Context()
    sockets = []
    for _ in range(args.senders):
        s = context.socket(zmq.DEALER)
        s.connect(address)
        sockets.append(s)
    payload = b"x" * args.size
    _paced(args.senders, args.rate, stop, lambda i: sockets[i].send(payload))


def _send_tcp(port: int, args, stop) -> None:
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.senders)]
    payload = _LENGTH.pack(args.size) + b"x" * args.size
    _paced(args.senders, args.rate, stop, lambda i: sockets[i].sendall(payload))


def _zmq_receiver(address_out, args, stop):
    """Start a gathering ZeroMQ receiver thread; returns a function giving messages read."""
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    address_out.put(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    count = [0]

    def serve():
        while not stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                count[0] += 1
            time.sleep(args.gather_ms / 1e3)

    threading.Thread(target=serve, daemon=True).start()
    return lambda: count[0]


def _tcp_receiver(address_out, args, stop):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    listener.setblocking(False)
    address_out.put(listener.getsockname()[1])
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    pending: dict[socket.socket, bytes] = {}
    count = [0]

    def serve():
        while not stop.is_set():
            if not selector.select(0.1):
                continue
            for key, _ in selector.select(0):
                conn = key.fileobj
                if conn is listener:
                    new, _ = listener.accept()
                    new.setblocking(False)
                    selector.register(new, selectors.EVENT_READ)
                    pending[new] = b""
                    continue
                data = pending[conn] + conn.recv(1 << 20)
                offset = 0
                while len(data) - offset >= _LENGTH.size:
                    (length,) = _LENGTH.unpack_from(data, offset)
                    if len(data) - offset - _LENGTH.size < length:
                        break
                    offset += _LENGTH.size + length
                    count[0] += 1
                pending[conn] = data[offset:]
            time.sleep(args.gather_ms / 1e3)

    threading.Thread(target=serve, daemon=True).start()
    return lambda: count[0]


def _receive(kind: str, args, address_out, result_out, start, stop) -> None:
    messages_read = (_zmq_receiver if kind == "zmq" else _tcp_receiver)(address_out, args, stop)
    start.wait()
    time.sleep(1.0)                       # connections up, in steady state
    cpu, count = _process_cpu_s(), messages_read()
    time.sleep(args.seconds)
    result_out.put((_process_cpu_s() - cpu, messages_read() - count))


def measure(kind: str, args) -> tuple[float, int]:
    """(receiver process CPU seconds, messages read) over ``args.seconds``."""
    address_out, result_out = mp.Queue(), mp.Queue()
    start, stop = mp.Event(), mp.Event()
    receiver = mp.Process(target=_receive, args=(kind, args, address_out, result_out, start, stop))
    receiver.start()
    address = address_out.get(timeout=30)
    sender = mp.Process(target=_send_zmq if kind == "zmq" else _send_tcp, args=(address, args, stop))
    sender.start()
    start.set()
    cpu_s, count = result_out.get(timeout=args.seconds + 60)
    stop.set()
    for process in (sender, receiver):
        process.join(3)
        if process.is_alive():
            process.kill()
    return cpu_s, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 14.0, 28.0],
                        help="messages per second per sender (one run each)")
    parser.add_argument("--size", type=int, default=1500, help="message bytes (a KV event batch: ~1.5 KB)")
    parser.add_argument("--gather-ms", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    rows = {}
    for rate in args.rates:
        for kind in ("zmq", "tcp"):
            args.rate = rate
            cpu_s, count = measure(kind, args)
            rows[kind, rate] = (cpu_s / args.seconds, count / args.seconds)
            print(f"{kind} at {rate:g}/s x {args.senders}: {count / args.seconds:.0f} messages/s, receiver process "
                  f"{100 * cpu_s / args.seconds:.1f}% of a core, {1e6 * cpu_s / max(count, 1):.1f} us per message",
                  flush=True)
    low, high = min(args.rates), max(args.rates)
    for kind in ("zmq", "tcp"):
        (cpu_low, msgs_low), (cpu_high, msgs_high) = rows[kind, low], rows[kind, high]
        if msgs_high > msgs_low:
            print(f"{kind}: marginal {1e6 * (cpu_high - cpu_low) / (msgs_high - msgs_low):.1f} us of receiver CPU "
                  f"per message between {low:g}/s and {high:g}/s per sender")


if __name__ == "__main__":
    main()

"""A small HTTP proxy on loopback that puts faults between an S3 client and its server.

Each request is read whole from the client, then, at random: forwarded and answered; answered
with 503 SlowDown or 500 InternalError without reaching the server; dropped (the connection
closed with no answer, the server never sees it); or forwarded and its answer cut off (halfway
through the body, or in the status line when there is no body: the server did the work, the
client sees a dropped connection). ``counts`` says
how many of each happened.

Tests that need one fault at one request give a ``rule``: it sees each request (method, target,
headers, body), may change its headers, and names the fault for it (or None: forwarded as is);
``after`` runs once a forwarded request was answered by the server, before its answer is sent
on (to let another writer act between a request and its answer).
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

FAULTS = ("503", "500", "dropped", "cut")
_ERRORS = {
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


@dataclass
class Request:
    """A request as the proxy read it; a ``rule`` may change its headers."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)

    def drop_header(self, name: str) -> None:
        for k in [k for k in self.headers if k.lower() == name.lower()]:
            del self.headers[k]


Rule = Callable[[Request], "str | None"]


class FaultProxy:
    """``FaultProxy(upstream_port, rates={"503": 0.05, ...})``; ``url`` is its endpoint."""

    def __init__(
        self,
        upstream_port: int,
        rates: dict[str, float],
        seed: int = 0,
        rule: Rule | None = None,
        after: Callable[[Request], None] | None = None,
    ) -> None:
        if set(rates) - set(FAULTS):
            raise ValueError(f"unknown faults {set(rates) - set(FAULTS)}")
        self.upstream_port = upstream_port
        self.rates = dict(rates)
        self.rule = rule
        self.after = after
        self.enabled = True
        self.counts: Counter[str] = Counter()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._server.close()

    def _choose(self, request: Request) -> str:
        with self._lock:
            self.counts["requests"] += 1
            if not self.enabled:
                return "ok"
            if self.rule is not None and (fault := self.rule(request)) is not None:
                self.counts[fault] += 1
                return fault
            x = self._random.random()
            for fault in FAULTS:
                x -= self.rates.get(fault, 0.0)
                if x < 0:
                    self.counts[fault] += 1
                    return fault
            return "ok"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while True:
                request = _read_request(rfile, conn)
                if request is None:
                    return
                fault = self._choose(request)
                if fault == "dropped":
                    return
                if fault in _ERRORS:
                    conn.sendall(_error_response(*_ERRORS[fault]))
                    continue
                if upstream is None:
                    upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port)
                upstream.request(
                    request.method, request.target, body=request.body, headers=request.headers
                )
                head, body = _response(upstream.getresponse(), request.method)
                if self.after is not None:
                    self.after(request)
                if fault == "cut":  # mid-body, or mid-status-line when there is no body
                    conn.sendall(head + body[: len(body) // 2] if body else head[:5])
                    return
                conn.sendall(head + body)
        except (OSError, http.client.HTTPException):
            return
        finally:
            if upstream is not None:
                upstream.close()
            rfile.close()
            conn.close()


def _read_request(rfile: BinaryIO, conn: socket.socket) -> Request | None:
    line = rfile.readline()
    if not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while (h := rfile.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip()] = value.strip()
    lower = {k.lower(): v for k, v in headers.items()}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if lower.get("transfer-encoding", "").lower() == "chunked":
        body = _read_chunked(rfile)
    else:
        body = rfile.read(int(lower.get("content-length", "0")))
    kept = {k: v for k, v in headers.items() if k.lower() not in _HOP | {"content-length"}}
    kept["Content-Length"] = str(len(body))
    return Request(method, target, kept, body)


def _read_chunked(rfile: BinaryIO) -> bytes:
    out = bytearray()
    while (size := int(rfile.readline().split(b";")[0], 16)) > 0:
        out += rfile.read(size)
        rfile.readline()
    while rfile.readline() not in (b"\r\n", b"\n", b""):
        pass
    return bytes(out)


def _response(resp: http.client.HTTPResponse, method: str) -> tuple[bytes, bytes]:
    """The upstream's answer as the head and the body to send on."""
    body = resp.read()
    head = [f"HTTP/1.1 {resp.status} {resp.reason}"]
    for k, v in resp.getheaders():
        if k.lower() in _HOP or (k.lower() == "content-length" and method != "HEAD"):
            continue
        head.append(f"{k}: {v}")
    if method != "HEAD":
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), body


def _error_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body

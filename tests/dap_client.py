"""A Debug Adapter Protocol client over TCP, what VS Code speaks to debugpy: for the tests and
benchmarks of ``%ring debugpy`` (tests/ is on sys.path: ``from dap_client import Dap``)."""

import json
import queue
import re
import socket
import threading
import time


class Dap:
    """A Debug Adapter Protocol client over a TCP socket (what VS Code speaks to debugpy)."""

    def __init__(self, port, timeout=30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.seq = 0
        self.responses = {}
        self.events = queue.Queue()
        self.lock = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buffer = b""
        self.sock.settimeout(None)
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self.events.put(None)
                return
            buffer += chunk
            while b"\r\n\r\n" in buffer:
                head, rest = buffer.split(b"\r\n\r\n", 1)
                length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
                if len(rest) < length:
                    break
                message, buffer = json.loads(rest[:length]), rest[length:]
                if message["type"] == "response":
                    with self.lock:
                        self.responses[message["request_seq"]] = message
                        self.lock.notify_all()
                elif message["type"] == "event":
                    self.events.put(message)

    def send(self, command, **arguments):
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command,
                           "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def request(self, command, **arguments):
        seq = self.send(command, **arguments)
        with self.lock:
            assert self.lock.wait_for(lambda: seq in self.responses, self.timeout), command
            response = self.responses.pop(seq)
        assert response["success"], response
        return response.get("body", {})

    def attach(self, breakpoints=None, **arguments):
        """VS Code's opening: initialize, attach (``arguments``: its configuration), the
        breakpoints (``{path: [line, ...]}``), configurationDone; the setBreakpoints answers."""
        self.request("initialize", clientID="jupyter_ring-test", adapterID="debugpy",
                     pathFormat="path", linesStartAt1=True, columnsStartAt1=True)
        self.request("attach", justMyCode=False, **arguments)
        placed = [self.request("setBreakpoints", source={"path": path},
                               breakpoints=[{"line": line} for line in lines])
                  for path, lines in (breakpoints or {}).items()]
        self.request("configurationDone")
        return placed

    def event(self, name):
        deadline = time.monotonic() + self.timeout
        while True:
            message = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            assert message is not None, f"the connection closed while waiting for {name!r}"
            if message["event"] == name:
                return message["body"]

    def close(self):
        self.sock.close()

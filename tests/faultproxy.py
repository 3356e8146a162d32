"""A TCP proxy on loopback that injects network faults between a client and a real server.

    with FaultProxy(("127.0.0.1", s3_port)) as proxy:   # clients connect to proxy.endpoint_url
        proxy.refuse()                    # the server looks unreachable: connections are reset
        proxy.blackhole()                 # connections open, nothing ever answers (timeouts)
        proxy.stall()                     # a silent partition: open connections stop moving bytes too
        proxy.cut_upload_after(1 << 20)   # the network dies after 1 MiB more of upload
        proxy.cut_download_after(1 << 20) # ... or after 1 MiB more of download (a GET dies mid-body)
        proxy.cut.wait(timeout=10)        # ... set once that cut happened
        proxy.pass_through()              # healthy again
        proxy.rewrite = fn                # fn(data, upload) -> data: every chunk passes through it

Every change of mode to `refuse` or `blackhole` also resets the connections already open:
HTTP clients keep connections alive in a pool, and a fault that spared them would not be one.
`stall` resets nothing: bytes in flight, a request half sent, simply stop (no RST, no FIN), and
flow again, intact, after `pass_through`; that is what a partition looks like to a client.
Threads: one acceptor, and one pump per direction of each connection; all are named, owned by
the proxy, and stop on `close()` (a wake-up byte for the acceptor, socket shutdown for pumps).
"""

from __future__ import annotations

import enum
import itertools
import selectors
import socket
import struct
import threading
from typing import Callable

HOST = "127.0.0.1"
_BUFSIZE = 64 * 1024


class Mode(enum.Enum):
    PASS = "pass"            # forward both ways
    REFUSE = "refuse"        # accept, then reset at once: "connection reset by peer"
    BLACKHOLE = "blackhole"  # accept and hold, never read or answer: the client times out
    CUT_UPLOAD = "cut"       # forward until an upload byte budget is spent, then reset
    STALL = "stall"          # nothing moves on any connection, nothing is reset: a silent partition
    CUT_DOWNLOAD = "cutdown"  # forward until a download byte budget is spent, then reset


class FaultProxy:
    """Forwards 127.0.0.1:`port` to `upstream`, with faults switched on and off by a test."""

    def __init__(self, upstream: tuple[str, int], *, name: str = "faultproxy"):
        self.upstream = upstream
        self.name = name
        self.cut = threading.Event()  # set when cut_upload_after() spent its budget
        self.accepted = 0             # connections accepted in any mode
        self.bytes_up = 0             # client -> server bytes forwarded
        self.cuts = 0                 # connections reset by an upload or download budget
        # Called by the pumps with each chunk read and its direction (True: client -> server); what it
        # returns is forwarded instead (damage in flight, headers a store does not know). None: untouched.
        self.rewrite: Callable[[bytes, bool], bytes] | None = None
        self._lock = threading.Lock()
        self._mode = Mode.PASS
        self._budget = 0
        self._then = Mode.REFUSE
        self._relays: set[_Relay] = set()
        self._held: list[socket.socket] = []
        self._ids = itertools.count(1)
        self._flowing = threading.Event()  # cleared while stalled: every pump waits on it
        self._flowing.set()
        self._closed = False
        self._acceptor: threading.Thread | None = None
        self._listener = socket.create_server((HOST, 0), backlog=128)
        self._wake_r, self._wake_w = socket.socketpair()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    def start(self) -> FaultProxy:
        """Start accepting; called once by the owner (or by `with`)."""
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept",
                                          daemon=True)
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop accepting, reset every connection and join all threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._acceptor is not None:
            self._wake_w.send(b"\0")  # the sentinel: the acceptor returns when it sees it
            self._acceptor.join()
        with self._lock:  # the acceptor is gone: these sets no longer grow
            relays, held = list(self._relays), self._drop_held()
        self._flowing.set()  # stalled pumps wake up and see their relay aborted
        for relay in relays:
            relay.abort(hard=True)
        for relay in relays:
            relay.join()
        for sock in held:
            _reset(sock)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- faults --------------------------------------------------------------------------------

    def pass_through(self) -> None:
        """Forward everything; connections held by `blackhole()` are reset."""
        self._set_mode(Mode.PASS)

    def refuse(self) -> None:
        """Reset open connections and every new one: the server is unreachable."""
        self._set_mode(Mode.REFUSE)

    def blackhole(self) -> None:
        """Reset open connections; accept new ones but never answer (the client must time out)."""
        self._set_mode(Mode.BLACKHOLE)

    def stall(self) -> None:
        """Stop every byte on open connections without resetting them; hold new ones unanswered."""
        self._set_mode(Mode.STALL)

    def cut_upload_after(self, nbytes: int, *, then: Mode = Mode.REFUSE) -> None:
        """Forward `nbytes` more upload bytes (all connections together), then reset the
        connection that crosses the budget and switch to `then` (REFUSE: the network stays
        down; PASS: a transient blip that a retry survives)."""
        if nbytes < 0 or then is Mode.CUT_UPLOAD:
            raise ValueError(f"cut_upload_after(nbytes={nbytes}, then={then}): nbytes must be "
                             ">= 0 and `then` one of PASS, REFUSE, BLACKHOLE")
        with self._lock:
            self.cut.clear()
            self._budget, self._then = nbytes, then
        self._set_mode(Mode.CUT_UPLOAD)

    def cut_download_after(self, nbytes: int, *, then: Mode = Mode.REFUSE) -> None:
        """Forward `nbytes` more download bytes (server -> client, all connections together), then
        reset the connection that crosses the budget and switch to `then`, as `cut_upload_after`."""
        if nbytes < 0 or then in (Mode.CUT_UPLOAD, Mode.CUT_DOWNLOAD):
            raise ValueError(f"cut_download_after(nbytes={nbytes}, then={then}): nbytes must be "
                             ">= 0 and `then` one of PASS, REFUSE, BLACKHOLE")
        with self._lock:
            self.cut.clear()
            self._budget, self._then = nbytes, then
        self._set_mode(Mode.CUT_DOWNLOAD)

    def _set_mode(self, mode: Mode) -> None:
        with self._lock:
            self._mode = mode
            held = self._drop_held() if mode not in (Mode.BLACKHOLE, Mode.STALL) else []
            doomed = list(self._relays) if mode in (Mode.REFUSE, Mode.BLACKHOLE) else []
        if mode is Mode.STALL:
            self._flowing.clear()
        else:
            self._flowing.set()  # stalled pumps go on (or, aborted just above, stop)
        for sock in held:
            _reset(sock)
        for relay in doomed:
            relay.abort()

    def _drop_held(self) -> list[socket.socket]:
        held, self._held = self._held, []
        return held

    # -- internals -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        client, _ = self._listener.accept()
                    except OSError:
                        continue
                    self._on_accept(client)

    def _on_accept(self, client: socket.socket) -> None:
        with self._lock:
            self.accepted += 1
            mode = self._mode
            if mode in (Mode.BLACKHOLE, Mode.STALL):
                self._held.append(client)
                return
        if mode is Mode.REFUSE:
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _reset(client)  # the real server is down: the client sees the same thing
            return
        relay = _Relay(self, client, upstream, next(self._ids))
        with self._lock:
            self._relays.add(relay)
        relay.start()

    def _allow(self, n: int, upload: bool) -> tuple[int, bool]:
        """Called by a pump with `n` bytes in hand: how many to forward, and whether to reset its
        connection afterwards. A budget counts the bytes of its own direction only."""
        budgeted = Mode.CUT_UPLOAD if upload else Mode.CUT_DOWNLOAD
        with self._lock:
            if self._mode is Mode.PASS or self._mode is (Mode.CUT_DOWNLOAD if upload else Mode.CUT_UPLOAD):
                self.bytes_up += n if upload else 0
                return n, False
            if self._mode is not budgeted:  # the mode changed under a pump that was already reading:
                return (0, True) if upload else (n, False)  # downloads are cut only by their budget
            if n <= self._budget:
                self._budget -= n
                self.bytes_up += n if upload else 0
                return n, False
            allowed, self._budget = self._budget, 0
            self.bytes_up += allowed if upload else 0
            self.cuts += 1
        self._set_mode(self._then)
        self.cut.set()
        return allowed, True

    def _forget(self, relay: _Relay) -> None:
        with self._lock:
            self._relays.discard(relay)


class _Relay:
    """One proxied connection: two pump threads; the last one out closes both sockets."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket,
                 ident: int):
        self._proxy = proxy
        self._client, self._upstream = client, upstream
        self._aborted = False
        self._alive = 2
        self._lock = threading.Lock()
        name = f"{proxy.name}-{ident}"
        self._threads = [
            threading.Thread(target=self._pump, args=(client, upstream, True),
                             name=f"{name}-up", daemon=True),
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             name=f"{name}-down", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()

    def abort(self, hard: bool = False) -> None:
        """Reset both sides. SHUT_RD wakes the pumps' blocking recv() without sending a FIN,
        so the pump's close (with SO_LINGER 0) sends an RST; `hard` also wakes a blocked send."""
        with self._lock:
            self._aborted = True
        for sock in (self._client, self._upstream):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR if hard else socket.SHUT_RD)
            except OSError:
                pass  # already closed by the last pump

    def _pump(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while not self._aborted:
                data = src.recv(_BUFSIZE)
                self._proxy._flowing.wait()  # stalled: hold the bytes (and everything behind them)
                if self._aborted:
                    break
                if not data:
                    if not self._aborted:
                        dst.shutdown(socket.SHUT_WR)  # pass the half-close on
                    break
                rewrite = self._proxy.rewrite
                if rewrite is not None:
                    data = rewrite(data, upload)
                cut = False
                if upload or self._proxy.mode is Mode.CUT_DOWNLOAD:
                    allowed, cut = self._proxy._allow(len(data), upload)
                    data = data[:allowed]
                if data:
                    dst.sendall(data)
                if cut:
                    self.abort()
                    break
        except OSError:
            self.abort()  # one side reset: reset the other too, as a broken network would
        finally:
            self._exit()

    def _exit(self) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            for sock in (self._client, self._upstream):
                sock.close()
            self._proxy._forget(self)


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets an RST instead of an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()

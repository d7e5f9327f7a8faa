"""A hub-compatible HTTP server on loopback for the download tests: the routes huggingface_hub's snapshot_download
uses (repo info, tree listing, HEAD/GET resolve). GET honours `Range: bytes=A-` / `bytes=A-B` as the hub does
(206 + Content-Range; 416 past the end). `cut[file] = N` makes every GET of that file drop the connection after N
bytes (until removed); `rate[file] = bytes/s` slows it down so a client can be killed part way; `sent[file]` counts
the body bytes written to clients, the server-side measure of what a (resumed) download fetched."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()  # one fixed revision per repo


class Hub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos  # repo id -> directory with its files
        self.ranges: list[tuple[str, int]] = []  # (file, first byte) of every GET
        self.cut: dict[str, int] = {}  # file -> bytes served per GET before the connection drops (until removed)
        self.rate: dict[str, float] = {}  # file -> bytes per second while serving it
        self.sent: dict[str, int] = {}  # file -> body bytes written so far, all GETs together
        self.lock = threading.Lock()
        self._etags: dict[Path, str] = {}
        hub = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _files(self, repo):
                d = hub.repos[repo]
                return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file()}

            def _json(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self.send_error(404)
                    files = self._files(repo)
                    if parts[4] == "revision":
                        return self._json({"id": repo, "sha": commit_of(repo), "siblings": [{"rfilename": f} for f in files]})
                    if parts[4] == "tree":
                        return self._json([{"type": "file", "path": f, "size": p.stat().st_size,
                                            "oid": hashlib.sha1(f.encode()).hexdigest()} for f, p in files.items()])
                repo, rest = "/".join(parts[:2]), parts[2:]
                if repo in hub.repos and rest[:1] == ["resolve"]:
                    name = "/".join(rest[2:])
                    p = self._files(repo).get(name)
                    if p is None:
                        return self.send_error(404)
                    return p, name, repo
                return self.send_error(404)

            def _etag(self, p):
                with hub.lock:
                    if p not in hub._etags:  # the hub's etag of an LFS file is its sha256
                        hub._etags[p] = hashlib.sha256(p.read_bytes()).hexdigest()
                    return hub._etags[p]

            def _headers(self, p, name, repo, rng=None):
                size = p.stat().st_size
                start, end = rng or (0, size - 1)
                self.send_response(206 if rng else 200)
                self.send_header("X-Repo-Commit", commit_of(repo))
                self.send_header("ETag", '"' + self._etag(p) + '"')
                self.send_header("Content-Length", str(end + 1 - start))
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()

            def _range(self, size):
                """(start, end) of a satisfiable single `bytes=A-[B]` range; None without one; False past the end."""
                h = self.headers.get("Range", "")
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", h.strip())
                if not m:
                    return None
                start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
                return (start, end) if start < size and start <= end else False

            def do_HEAD(self):
                r = self._route()
                if r:
                    self._headers(*r)

            def do_GET(self):
                r = self._route()
                if not r:
                    return
                p, name, repo = r
                size = p.stat().st_size
                rng = self._range(size)
                if rng is False:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = rng or (0, size - 1)
                hub.ranges.append((name, start))
                self._headers(p, name, repo, rng)
                cut, rate = hub.cut.get(name), hub.rate.get(name)
                todo = end + 1 - start if cut is None else min(cut, end + 1 - start)
                step = 1 << 16
                try:
                    with open(p, "rb") as f:
                        f.seek(start)
                        while todo > 0:
                            chunk = f.read(min(step, todo))
                            self.wfile.write(chunk)
                            with hub.lock:
                                hub.sent[name] = hub.sent.get(name, 0) + len(chunk)
                            todo -= len(chunk)
                            if rate:
                                time.sleep(len(chunk) / rate)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client went away (killed): nothing to finish
                    self.close_connection = True
                    return
                if cut is not None:
                    self.close_connection = True
                    self.connection.shutdown(2)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

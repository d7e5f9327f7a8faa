"""A hub-compatible HTTP server on loopback for the download tests: the routes huggingface_hub's snapshot_download
uses (repo info, tree listing, HEAD/GET resolve with Range). `cut_after` makes the first GET of one file drop the
connection after N bytes (until removed), so an interrupted download and the re-run can be shown through the
real client."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()  # one fixed revision per repo


class Hub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos  # repo id -> directory with its files
        self.ranges: list[tuple[str, int]] = []  # (file, first byte) of every GET
        self.cut: dict[str, int] = {}  # file -> bytes served per GET before the connection drops (until removed)
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

            def _headers(self, p, name, repo, start=0):
                size = p.stat().st_size
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit_of(repo))
                self.send_header("ETag", '"' + hashlib.sha256(p.read_bytes()).hexdigest() + '"')
                self.send_header("Content-Length", str(size - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()

            def do_HEAD(self):
                r = self._route()
                if r:
                    self._headers(*r)

            def do_GET(self):
                r = self._route()
                if not r:
                    return
                p, name, repo = r
                rng = self.headers.get("Range", "")
                start = int(rng.split("=")[1].split("-")[0]) if rng.startswith("bytes=") else 0
                hub.ranges.append((name, start))
                self._headers(p, name, repo, start)
                data = p.read_bytes()[start:]
                cut = hub.cut.get(name)
                if cut is not None:
                    self.wfile.write(data[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

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

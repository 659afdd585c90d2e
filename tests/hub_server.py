"""A small Hub-compatible HTTP server on 127.0.0.1 for upload tests: it speaks the part of the Hugging Face Hub API
that `huggingface_hub`'s create_repo / create_branch / upload_folder use (repo creation, pre-upload, NDJSON commit
with base64 files), and keeps what it receives in memory. Anything else is a 404 that the test will see."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.requests: list[str] = []
        self.fail_commits = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(f"POST {self.path}")
                if self.path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if self.path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    private = req.get("private", req.get("visibility") == "private")  # older and newer clients
                    hub.repos.setdefault(repo_id, {"private": private, "branches": {"main": {}}})
                    return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)$", self.path)
                if not m or m.group(1) not in hub.repos:
                    return self._reply(404, {"error": f"unknown {self.path}"})
                repo, action, rev = m.group(1), m.group(2), m.group(3).replace("%2F", "/")
                branches = hub.repos[repo]["branches"]
                if action == "branch":
                    branches.setdefault(rev, dict(branches["main"]))
                    return self._reply(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]})
                if hub.fail_commits:
                    return self._reply(500, {"error": "the fake hub is down"})
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        branches.setdefault(rev, {})[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                oid = hashlib.sha1(body).hexdigest()
                return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{oid}",
                                         "commitOid": oid})

            def do_GET(self):
                hub.requests.append(f"GET {self.path}")
                return self._reply(404, {"error": f"unknown {self.path}"})

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

"""A small Hub-compatible HTTP server on 127.0.0.1 for upload tests: it speaks the part of the Hugging Face Hub API
that `huggingface_hub`'s create_repo / create_branch / upload_folder use (repo creation, pre-upload, NDJSON commit
with base64 files), and keeps what it receives in memory. Anything else is a 404 that the test will see.

Model card metadata is checked as the Hub checks it (`validate_card`): on `/api/validate-yaml` (what
`ModelCard.validate()` calls) and on every commit that writes a README.md, which the Hub refuses with HTTP 400 and its
message when the metadata is invalid. The rules are the Hub's published ones (hub-docs modelcard.md and
repositories-licenses.md): a known licence id (`other` with license_name and license_link), valid repo ids in
base_model and datasets, a known base_model_relation and pipeline_tag, tags as strings, and a well-formed model-index
that huggingface_hub's own parser reads."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

# https://huggingface.co/docs/hub/repositories-licenses (the Hub's list; kept here apart from align's own copy in
# align/hub.py, so that a wrong entry there is caught here).
LICENSES = {
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0",
    "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0", "cc-by-nc-nd-3.0",
    "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0", "cdla-sharing-1.0",
    "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1",
    "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc", "lppl-1.3c", "ms-pl",
    "mpl-2.0", "odc-by", "odbl", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib",
    "pddl", "lgpl-lr", "deepfloyd-if-license", "llama2", "llama3", "llama3.1", "llama3.2", "llama3.3", "gemma",
    "unknown", "other",
}
# The Hub's tasks (huggingface.js pipelines), the values `pipeline_tag` takes.
PIPELINE_TAGS = {
    "text-classification", "token-classification", "table-question-answering", "question-answering",
    "zero-shot-classification", "translation", "summarization", "feature-extraction", "text-generation",
    "text2text-generation", "fill-mask", "sentence-similarity", "text-to-speech", "text-to-audio",
    "automatic-speech-recognition", "audio-to-audio", "audio-classification", "audio-text-to-text",
    "voice-activity-detection", "depth-estimation", "image-classification", "object-detection", "image-segmentation",
    "text-to-image", "image-to-text", "image-to-image", "image-to-video", "unconditional-image-generation",
    "video-classification", "reinforcement-learning", "robotics", "tabular-classification", "tabular-regression",
    "tabular-to-text", "table-to-text", "multiple-choice", "text-ranking", "text-retrieval", "time-series-forecasting",
    "text-to-video", "image-text-to-text", "visual-question-answering", "document-question-answering",
    "zero-shot-image-classification", "graph-ml", "mask-generation", "zero-shot-object-detection", "text-to-3d",
    "image-to-3d", "image-feature-extraction", "video-text-to-text", "keypoint-detection",
    "visual-document-retrieval", "any-to-any", "video-to-video", "other",
}
BASE_MODEL_RELATIONS = {"adapter", "merge", "quantized", "finetune"}
_LICENSE_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def _ids(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _repo_id_problem(value: Any) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(value, str):
        return "is not a string"
    try:
        validate_repo_id(value)
    except HFValidationError as e:
        return str(e).splitlines()[0]
    return ""


def _model_index_problems(model_index: Any) -> list[str]:
    from huggingface_hub.repocard_data import model_index_to_eval_results

    if not isinstance(model_index, list) or not model_index:
        return ['"model-index" must be a non-empty array']
    problems = []
    for i, entry in enumerate(model_index):
        where = f'"model-index[{i}]"'
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            problems.append(f'{where}.name is required')
            continue
        results = entry.get("results")
        if not isinstance(results, list) or not results:
            problems.append(f"{where}.results must be a non-empty array")
            continue
        for j, result in enumerate(results):
            at = f"{where}.results[{j}]"
            result = result if isinstance(result, dict) else {}
            task, dataset, metrics = result.get("task"), result.get("dataset"), result.get("metrics")
            if not isinstance(task, dict) or not isinstance(task.get("type"), str):
                problems.append(f'{at}.task.type is required')
            if not isinstance(dataset, dict) or not isinstance(dataset.get("type"), str):
                problems.append(f'{at}.dataset.type is required')
            if not isinstance(dataset, dict) or not isinstance(dataset.get("name"), str):
                problems.append(f'{at}.dataset.name is required')
            if not isinstance(metrics, list) or not metrics:
                problems.append(f"{at}.metrics must be a non-empty array")
                continue
            for k, metric in enumerate(metrics):
                if not isinstance(metric, dict) or not isinstance(metric.get("type"), str):
                    problems.append(f'{at}.metrics[{k}].type is required')
                if not isinstance(metric, dict) or "value" not in metric or metric["value"] is None:
                    problems.append(f'{at}.metrics[{k}].value is required')
    if not problems:
        try:
            model_index_to_eval_results(model_index)
        except Exception as e:  # what huggingface_hub cannot read, the Hub's UI cannot show either
            problems.append(f'"model-index" cannot be parsed: {type(e).__name__}: {e}')
    return problems


def validate_card(content: str) -> list[str]:
    """The Hub's checks of a model card's YAML front matter: one message per problem, none for a valid card."""
    if not content.startswith("---"):
        return []  # no metadata: nothing to check (the Hub shows a warning, not an error)
    parts = content.split("\n---", 1)
    if len(parts) < 2:
        return ["the metadata block is not closed by ---"]
    try:
        metadata = yaml.safe_load(parts[0][3:]) or {}
    except yaml.YAMLError as e:
        return [f"the metadata is not valid YAML: {str(e).splitlines()[0]}"]
    if not isinstance(metadata, dict):
        return ["the metadata must be a YAML mapping"]
    problems = []
    if "license" in metadata:
        licenses = _ids(metadata["license"])
        for value in licenses:
            if value not in LICENSES:
                problems.append(f'"license" must be one of [{", ".join(sorted(LICENSES))}] (got {value!r})')
        if "other" in licenses:
            name, link = metadata.get("license_name"), metadata.get("license_link")
            if not isinstance(name, str) or not _LICENSE_NAME.match(name):
                problems.append('"license_name" is required with license other: a lowercase id such as my-license-1.0')
            if not isinstance(link, str) or not link:
                problems.append('"license_link" is required with license other: a URL or a file of the repo')
    if "base_model" in metadata:
        for value in _ids(metadata["base_model"]):
            problem = _repo_id_problem(value)
            if problem:
                problems.append(f'"base_model" with value {value!r} is not a valid model id ({problem})')
    if "base_model_relation" in metadata:
        if metadata["base_model_relation"] not in BASE_MODEL_RELATIONS:
            problems.append(f'"base_model_relation" must be one of [{", ".join(sorted(BASE_MODEL_RELATIONS))}]')
        if "base_model" not in metadata:
            problems.append('"base_model_relation" needs "base_model"')
    if "datasets" in metadata:
        for value in _ids(metadata["datasets"]):
            problem = _repo_id_problem(value)
            if problem:
                problems.append(f'"datasets" with value {value!r} is not a valid dataset id ({problem})')
    if "pipeline_tag" in metadata and metadata["pipeline_tag"] not in PIPELINE_TAGS:
        problems.append(f'"pipeline_tag" must be one of the Hub\'s tasks (got {metadata["pipeline_tag"]!r})')
    if "tags" in metadata and not all(isinstance(t, str) for t in _ids(metadata["tags"])):
        problems.append('"tags" must be an array of strings')
    if "library_name" in metadata and not isinstance(metadata["library_name"], str):
        problems.append('"library_name" must be a string')
    if "model-index" in metadata:
        problems += _model_index_problems(metadata["model-index"])
    return problems


def invalid_metadata(problems: list[str]) -> str:
    return "Invalid metadata in README.md.\n" + "\n".join(f"- {p}" for p in problems)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.requests: list[str] = []
        self.fail_commits = False
        self.validated: list[list[str]] = []  # the problems found in each card checked, in order
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

            def _refuse(self, problems: list[str]) -> None:
                """HTTP 400 with the Hub's message: as text when the client asks for text (ModelCard.validate)."""
                if "text/plain" in self.headers.get("Accept", ""):
                    data = invalid_metadata(problems).encode()
                    self.send_response(400)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self._reply(400, {"error": invalid_metadata(problems)})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(f"POST {self.path}")
                if self.path == "/api/validate-yaml":
                    problems = validate_card(json.loads(body).get("content", ""))
                    hub.validated.append(problems)
                    if problems:
                        return self._refuse(problems)
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
                files = {}
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                if "README.md" in files:  # the Hub refuses a commit whose card metadata is invalid
                    problems = validate_card(files["README.md"].decode())
                    hub.validated.append(problems)
                    if problems:
                        return self._refuse(problems)
                branches.setdefault(rev, {}).update(files)
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

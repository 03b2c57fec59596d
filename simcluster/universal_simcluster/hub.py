"""A loopback Hugging Face hub: the hub's file API over local folders, so the real download code runs.

No model hub is reachable here. Pointing ``HF_ENDPOINT`` at this server makes ``huggingface_hub`` (local mode's
``snapshot_download``, KServe's ``kserve-storage`` hf:// path) do what it does against huggingface.co: resolve a
revision, list the files, HEAD and GET each one, and turn a refusal into the error it raises there.

The hub server's code is not public: its behaviour is known here only through its client, the pinned
``huggingface_hub`` 2.4.0, and each answer below cites the client code that reads it. What this server serves:

* ``GET /api/models/{repo}/revision/{rev}``: ``{"id", "sha", "siblings": [{"rfilename"}], ...}``, read by
  ``HfApi.model_info`` (hf_api.py, ``ModelInfo.__init__``); ``snapshot_download`` (_snapshot_download.py) takes
  ``sha`` as the commit to fetch.
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=``: ``[{"type": "file", "path", "size", "oid"}, ...]``,
  read by ``HfApi.list_repo_tree`` (hf_api.py ``_iter_repo_tree_pages``, ``RepoFile``/``RepoFolder``); one page,
  no ``Link`` header (utils/_pagination.py follows one when present).
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (constants.py ``HUGGINGFACE_CO_URL_TEMPLATE``): ``X-Repo-Commit``,
  ``ETag`` (the git blob id, as for a file not in LFS) and ``Content-Length``, read by ``get_hf_file_metadata``
  (file_download.py); a ``Range: bytes=N-`` GET answers 206 with ``Content-Range`` (``http_get`` resumes so).
  No ``X-Xet-*`` header, so the client downloads over plain HTTP (utils/_xet.py
  ``parse_xet_file_data_from_response``).
* Refusals carry ``X-Error-Code`` as utils/_http.py ``hf_raise_for_status`` maps it: ``RepoNotFound`` (404),
  ``RevisionNotFound`` (404), ``EntryNotFound`` (404, with ``X-Repo-Commit``: file_download.py caches the
  absence under that commit), ``GatedRepo``: 401 without a token, 403 with a token the repository does not
  accept (the client raises ``GatedRepoError`` for both).

A revision is a branch name or the full commit id this server gives it (deterministic: a digest of the name and
the files). Files are read from disk on each request, so a test may not change a folder while it is served.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

#: huggingface_hub 2.4.0 constants.py DEFAULT_REVISION: the branch a download without a revision asks for.
DEFAULT_BRANCH = "main"


@dataclass(frozen=True)
class Repository:
    """One model repository: its branches (name -> the folder holding that branch's files) and, if gated,
    the one token it accepts."""

    repo_id: str
    branches: Mapping[str, Path]
    token: str | None = None
    commits: dict[str, str] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        for branch, folder in self.branches.items():
            digest = hashlib.sha1(f"{self.repo_id}\0{branch}".encode())
            for path in sorted(files(folder)):
                digest.update(path.encode() + b"\0" + blob_id((folder / path).read_bytes()).encode())
            self.commits[digest.hexdigest()] = branch

    def commit_of(self, branch: str) -> str:
        return next(commit for commit, name in self.commits.items() if name == branch)

    def resolve(self, revision: str) -> tuple[str, Path] | None:
        """(commit, folder) for a branch name or a commit id; None for a revision the repository lacks."""
        if revision in self.branches:
            return self.commit_of(revision), self.branches[revision]
        if revision in self.commits:
            return revision, self.branches[self.commits[revision]]
        return None


def files(folder: Path) -> list[str]:
    """The repository paths ('/'-separated) of every file under ``folder``, following links as git would not:
    a test's folder may link its model in."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def blob_id(content: bytes) -> str:
    """git's blob id (SHA-1 of ``blob <size>\\0`` and the bytes): the ETag the hub gives a file not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class LoopbackHub:
    """The hub on a free loopback port, in a thread: ``with LoopbackHub(repos) as hub: ... hub.endpoint``."""

    def __init__(self, repositories: list[Repository], host: str = "127.0.0.1") -> None:
        self.repositories = {r.repo_id: r for r in repositories}
        #: Every request as (method, path, whether it carried a bearer token): what a test may check was asked.
        self.requests: list[tuple[str, str, bool]] = []
        #: The paths answered in part (206), with the Range asked: a resumed download.
        self.partial: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="loopback-hub", daemon=True)

    @property
    def endpoint(self) -> str:
        """The value for ``HF_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> LoopbackHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class Refusal(Exception):
    """An answer with the hub's error headers (``X-Error-Code``, ``X-Error-Message``)."""

    def __init__(self, status: HTTPStatus, code: str, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/(?P<path>.+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(?P<start>\d+)-(?P<end>\d*)$")


def _handler(hub: LoopbackHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects of the hub

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the requests are kept in hub.requests

        def _answer(self, *, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            token = _bearer(self.headers.get("Authorization"))
            hub.requests.append((self.command, path, token is not None))
            try:
                if match := _API.match(url.path):
                    repo, (commit, folder) = self._open(match["repo"], unquote(match["rev"]), token)
                    if match["kind"] == "revision":
                        self._json(_model_info(repo, commit, folder), body)
                    else:
                        recursive = parse_qs(url.query).get("recursive", ["False"])[0].lower() == "true"
                        self._json(_tree(folder, unquote(match["path"] or ""), recursive), body)
                elif match := _RESOLVE.match(url.path):
                    repo, (commit, folder) = self._open(match["repo"], unquote(match["rev"]), token)
                    self._file(folder, unquote(match["path"]), commit, body)
                else:
                    raise Refusal(HTTPStatus.NOT_FOUND, "RepoNotFound", f"no route for {path}")
            except Refusal as refusal:
                self._refuse(refusal, body)

        def _open(self, repo_id: str, revision: str, token: str | None) -> tuple[Repository, tuple[str, Path]]:
            repo = hub.repositories.get(repo_id)
            if repo is None:
                raise Refusal(HTTPStatus.NOT_FOUND, "RepoNotFound", "Repository not found")
            if repo.token is not None and token != repo.token:
                # Gated: 401 asks for a login, 403 says this token has no access (utils/_http.py maps both
                # to GatedRepoError by the code).
                status = HTTPStatus.UNAUTHORIZED if token is None else HTTPStatus.FORBIDDEN
                raise Refusal(status, "GatedRepo", f"Access to model {repo_id} is restricted.")
            resolved = repo.resolve(revision)
            if resolved is None:
                raise Refusal(HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {revision}")
            return repo, resolved

        def _file(self, folder: Path, path: str, commit: str, body: bool) -> None:
            target = folder / path
            if ".." in Path(path).parts or not target.is_file():
                raise Refusal(HTTPStatus.NOT_FOUND, "EntryNotFound", f"{path} does not exist", commit=commit)
            content = target.read_bytes()
            status, start, end = HTTPStatus.OK, 0, len(content)
            wanted = _RANGE.match(self.headers.get("Range") or "")
            if wanted and body:
                start = int(wanted["start"])
                end = min(int(wanted["end"]) + 1, end) if wanted["end"] else end
                status = HTTPStatus.PARTIAL_CONTENT
                hub.partial.append((unquote(urlsplit(self.path).path), wanted.string))
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{blob_id(content)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if status is HTTPStatus.PARTIAL_CONTENT:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(content)}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if body:
                self.wfile.write(content[start:end])

        def _json(self, data: object, body: bool) -> None:
            payload = json.dumps(data).encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _refuse(self, refusal: Refusal, body: bool) -> None:
            payload = json.dumps({"error": refusal.message}).encode()
            self.send_response(refusal.status)
            self.send_header("X-Error-Code", refusal.code)
            self.send_header("X-Error-Message", refusal.message)
            if refusal.commit is not None:
                self.send_header("X-Repo-Commit", refusal.commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

    return Handler


def _bearer(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _model_info(repo: Repository, commit: str, folder: Path) -> dict[str, Any]:
    return {
        "id": repo.repo_id,
        "sha": commit,
        "private": False,
        "gated": "manual" if repo.token is not None else False,
        "siblings": [{"rfilename": path} for path in files(folder)],
    }


def _tree(folder: Path, under: str, recursive: bool) -> list[dict[str, Any]]:
    """The entries under ``under``: every file when recursive, else the files and folders one level down."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    entries: dict[str, dict[str, Any]] = {}
    for path in files(folder):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :]
        if recursive or "/" not in rest:
            content = (folder / path).read_bytes()
            entries[path] = {"type": "file", "path": path, "size": len(content), "oid": blob_id(content)}
        else:
            directory = prefix + rest.split("/", 1)[0]
            entries.setdefault(directory, {"type": "directory", "path": directory, "size": 0, "oid": blob_id(b"")})
    return list(entries.values())

"""What a Hugging Face hub may answer a download, checked before huggingface_hub builds paths of it.
No torch here.

huggingface_hub names cache files by what the server says: the commit id (the snapshot folder), each
file's ETag (its blob and lock file). ``listing`` checks the one listing kvsnap asks for (a commit id of
40 hex digits, file names that stay in the repo, sizes); ``check_response``, a hook on the shared HTTP
client, checks every answer while a file is fetched (``expecting``): the listed commit, an ETag that is
a plain token, no more bytes than listed, the body counted as it streams; ``check_file`` checks what
the download left before the model is called ready: a regular file of its listed size in the repo's
``blobs`` folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsnap.errors import ModelError

# Small JSON files that transformers reads whole: bounded as kvsnap's own reads of them are.
SMALL_JSON = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.json",
        "preprocessor_config.json",
        "model.safetensors.index.json",
    }
)
SMALL_JSON_LIMIT = 16 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG = re.compile(r'(W/)?"[0-9A-Za-z_-]{1,128}"|[0-9A-Za-z_-]{1,128}')


def listing(where: str, repo: str, info: Any) -> tuple[str, dict[str, int | None]]:
    """The commit ``where``'s listing of ``repo`` names and its files' sizes, checked: a commit id of
    40 hex digits, file names that stay inside a folder."""
    commit = info.sha
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise ModelError(f"{where} listed {repo} with a commit id that is not one ({str(commit)[:48]!r}); not fetched")
    sizes: dict[str, int | None] = {}
    for sibling in info.siblings or []:
        f, size = sibling.rfilename, sibling.size
        if not plain_name(f):
            raise ModelError(f"{where} listed {repo} with a file name outside the repo ({str(f)[:80]!r}); not fetched")
        sizes[f] = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
    return commit, sizes


def plain_name(name: object) -> bool:
    if not isinstance(name, str) or not name or len(name) > 1024 or "\\" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/")) and name.isprintable()


def check_declared(where: str, repo: str, f: str, size: int | None) -> None:
    """Refuse a file whose size the listing does not say, or a small JSON file listed larger than kvsnap reads."""
    if size is None:
        raise ModelError(f"{where} does not list the size of {repo}'s {f}; not fetched")
    if f.rsplit("/", 1)[-1] in SMALL_JSON and size > SMALL_JSON_LIMIT:
        raise ModelError(
            f"{repo}'s {f} is listed as {size:,} bytes, more than {SMALL_JSON_LIMIT >> 20} MiB; not fetched"
        )


@dataclass
class Expected:
    """What the file being fetched in this thread may be: its repo's listed commit and size."""

    where: str  # the hub's address
    cache: Path  # the repo's folder in the hub cache
    repo: str
    file: str
    commit: str
    size: int
    etag: str | None = None  # the blob name the answers gave (its partial download is removed on refusal)


_state = threading.local()


@contextlib.contextmanager
def expecting(expected: Expected) -> Iterator[None]:
    _state.expected = expected
    try:
        yield
    except ModelError:
        if expected.etag is not None:
            # A body refused half way leaves huggingface_hub's partial file; nothing it holds is wanted.
            with contextlib.suppress(OSError):
                partial = expected.cache / "blobs" / f"{expected.etag}.incomplete"
                if stat.S_ISREG(os.lstat(partial).st_mode):
                    partial.unlink()
        raise
    finally:
        _state.expected = None


def check_response(response: Any) -> None:
    """A hook on every answer while a file is fetched (``expecting``): refuse a commit id, an ETag
    or a size that is not what the listing said, and count the body against the listed size."""
    expected: Expected | None = getattr(_state, "expected", None)
    if expected is None:
        return
    headers, what = response.headers, f"{expected.where} answered for {expected.repo}'s {expected.file}"
    commit = headers.get("X-Repo-Commit")
    if commit is not None and commit != expected.commit:
        raise ModelError(f"{what} with commit {commit[:48]!r}, not the listed {expected.commit}; not fetched")
    # huggingface_hub names the blob by the ETag of the HEAD answer; a GET's (a CDN's) is not used.
    for header in ("X-Linked-Etag", "ETag") if response.request.method == "HEAD" else ():
        etag = headers.get(header)
        if etag is not None and not _ETAG.fullmatch(etag):
            raise ModelError(f"{what} with an ETag that is not a plain token ({etag[:48]!r}); not fetched")
        if etag is not None and expected.etag is None:
            expected.etag = etag.removeprefix("W/").strip('"')
    for header in ("X-Linked-Size", "Content-Length"):
        value = headers.get(header)
        if value is not None and (not value.isdigit() or int(value) > expected.size) and not response.is_redirect:
            raise ModelError(f"{what} with {value[:24]} bytes where its listing says {expected.size:,}; not fetched")
    if response.request.method == "GET" and response.status_code in (200, 206):
        response.stream = bounded(response.stream, expected, what)


def bounded(stream: Any, expected: Expected, what: str) -> Any:
    """A response body that stops with ``ModelError`` past the listed size (a chunked body says none)."""
    import httpx2  # huggingface_hub's HTTP client

    class Bounded(httpx2.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            seen = 0
            for chunk in stream:
                seen += len(chunk)
                if seen > expected.size:
                    raise ModelError(f"{what} with more bytes than its listing says ({expected.size:,}); stopped")
                yield chunk

        def close(self) -> None:
            stream.close()

    return Bounded()


def check_file(expected: Expected, path: Path) -> Path:
    """``path``, once it is the listed file: in the snapshot folder of the listed commit, resolving to
    a regular file of the listed size in the repo's ``blobs`` folder."""
    cache, repo, f, size = expected.cache, expected.repo, expected.file, expected.size
    blobs = os.path.realpath(cache / "blobs")
    real = os.path.realpath(path)
    listed = cache / "snapshots" / expected.commit / f
    ok = os.path.abspath(path) == os.path.abspath(listed) and os.path.dirname(real) == blobs
    try:
        st = os.lstat(real)
        ok = ok and stat.S_ISREG(st.st_mode) and st.st_size == size
    except OSError:
        ok = False
    if not ok:
        raise ModelError(f"{repo}'s {f} did not download as listed (a {size:,}-byte file in {cache}); not used")
    return path


def inside_cache(cache: Path, path: Path) -> bool:
    """Whether ``path`` (a snapshot folder, or one file in it) holds only regular files of the repo's
    cache folder ``cache``: a link out of its ``blobs`` folder (what a hostile hub made of an earlier
    download) means the copy is not used."""
    blobs = os.path.realpath(cache / "blobs")
    if path.is_dir() and not path.is_symlink():
        entries = [Path(top) / name for top, dirs, files in os.walk(path) for name in (*dirs, *files)]
    else:
        entries = [path]
    for entry in entries:
        mode = os.lstat(entry).st_mode
        if stat.S_ISLNK(mode):
            real = os.path.realpath(entry)
            if os.path.dirname(real) != blobs or not stat.S_ISREG(os.lstat(real).st_mode):
                return False
        elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return False
    return True

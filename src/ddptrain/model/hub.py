"""timm's published weights, from the Hugging Face Hub's cache: `--pretrained` alone with
`-a timm:NAME[.TAG]`.

The cache is the Hub's own (HF_HOME, HF_HUB_CACHE): weights fetched ahead with `hf download` on
a machine with a network are found on compute nodes without one. A cached file is taken without
asking the Hub; a missing one is downloaded, after a quick check that the Hub can be reached at
all: the Hub's client retries an unreachable host for about half a minute, printing each retry,
where a user wants one line at once.
"""

import hashlib
import os
import re
import socket
import urllib.parse
import urllib.request
from pathlib import Path

from ddptrain.errors import UserError, first_line

WEIGHTS_FILE = "model.safetensors"  # what timm publishes on the Hub, tensors only
# The cache keeps a large file's bytes in `blobs/<sha256 of them>`, which the snapshot links to.
HASHED_BLOB = re.compile(r"[0-9a-f]{64}")
REACH_TIMEOUT = 5.0  # seconds to connect to the Hub before calling it unreachable


def weights_file(repo: str, filename: str = WEIGHTS_FILE) -> Path:
    """The cached path of `filename` of the Hub repository `repo` (`timm/NAME.TAG`, optionally
    `@REVISION`), downloaded into the cache first where it is not there."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    where = dict(repo_id=repo_id, filename=filename, revision=revision or None)
    try:
        cached = Path(hf_hub_download(**where, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    else:
        return _intact(cached, repo_id, filename, revision)
    unreachable = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _unreachable()
    if unreachable is None:
        try:
            return Path(hf_hub_download(**where))
        except (HfHubHTTPError, OSError, ValueError) as err:
            unreachable = first_line(err)
    raise UserError(
        f"--pretrained: the weights {repo_id} ({filename}) are not in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE} and cannot be downloaded ({unreachable}); fetch them ahead "
        f"where there is a network, with `hf download {repo_id} {filename}` into the same cache "
        "(HF_HOME), or pass --pretrained FILE"
    )


def _intact(path: Path, repo_id: str, filename: str, revision: str) -> Path:
    """path, a cached file, if its bytes are those published: a safetensors file, and where
    the cache names its bytes by their sha256, those. A torn download or a damaged disk
    otherwise ends in a traceback from the library that reads it, or loads unnoticed."""
    from safetensors import SafetensorError, safe_open

    blob = path.resolve()
    try:
        with safe_open(blob, framework="pt"):
            pass
        damage = _hash_mismatch(blob)
    except (SafetensorError, OSError) as err:
        damage = first_line(err)
    if damage is None:
        return path
    again = f"hf download {repo_id} {filename} --force-download"
    again += f" --revision {revision}" if revision else ""
    raise UserError(
        f"--pretrained: {blob}, {repo_id}'s {filename} in the Hugging Face cache, is damaged "
        f"({damage}); fetch it again with `{again}` (where there is a network, into the same "
        "cache: HF_HOME)"
    )


def _hash_mismatch(blob: Path) -> str | None:
    if not HASHED_BLOB.fullmatch(blob.name):
        return None  # a file the Hub keeps in git, small: named by git's hash, not checked
    with open(blob, "rb") as f:
        found = hashlib.file_digest(f, "sha256").hexdigest()
    return None if found == blob.name else f"its sha256 is {found[:12]}..., not {blob.name[:12]}..."


def _unreachable() -> str | None:
    """Why the Hub cannot be reached, or None if it answers a TCP connection (or a proxy,
    which this cannot check, stands between)."""
    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    if urllib.request.getproxies().get(url.scheme) or os.environ.get("ALL_PROXY"):
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=REACH_TIMEOUT):
            return None
    except OSError as err:
        return f"{url.hostname} unreachable: {err.strerror or err}"

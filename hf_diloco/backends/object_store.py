"""The store of `exchange: store` (`hf_diloco.core.store`), reached with obstore (the Rust `object_store` crate's
Python binding: S3 and every S3-compatible server, GCS, Azure, local folders), imported only where a run sets it.

| `store_url` | the store | credentials (environment only) |
|---|---|---|
| `file:///shared/path` | a folder (local disk, NFS) | none |
| `s3://bucket/prefix` | S3, or any S3-compatible server at `AWS_ENDPOINT_URL` (R2, MinIO) | `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (`AWS_SESSION_TOKEN`), `AWS_REGION` |
| `hf://buckets/owner/name/prefix` | a Hugging Face Storage Bucket through its S3-compatible gateway, `https://s3.hf.co/owner` (`AWS_ENDPOINT_URL` overrides it) | the S3 credentials generated from an HF token (`AWS_ACCESS_KEY_ID` = `HFAK...`, `AWS_SECRET_ACCESS_KEY`) |
| `gs://bucket/prefix` | Google Cloud Storage | `GOOGLE_APPLICATION_CREDENTIALS` / `GOOGLE_SERVICE_ACCOUNT` |
| `az://container/prefix` | Azure Blob Storage | `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY` |

A round's manifest is written create-if-absent (S3 `If-None-Match: *`; `O_EXCL` semantics on a folder); a site
checks at start that its store refuses a second create of one name (`hf_diloco.core.store.objects`).
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

from ..core.store.objects import ObjectStore


class ObstoreStore:
    """`ObjectStore` on an obstore store; `url` is what messages show (no credentials)."""

    def __init__(self, store: object, url: str):
        import obstore

        self._obstore = obstore
        self._store = store
        self.url = url

    def put(self, key: str, data: bytes | memoryview, create_only: bool = False) -> bool:
        from obstore.exceptions import AlreadyExistsError

        try:
            if create_only:  # one request, so that the condition holds for the whole object
                self._obstore.put(self._store, key, bytes(data), mode="create", use_multipart=False)
            else:
                self._obstore.put(self._store, key, bytes(data))
        except AlreadyExistsError:
            return False
        return True

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self._obstore.get(self._store, key).bytes())
        except FileNotFoundError:
            return None

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        try:
            return bytes(self._obstore.get_range(self._store, key, start=start, end=end))
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[str]:
        return [entry["path"] for entry in self._obstore.list(self._store, prefix=prefix).collect()]

    def delete(self, keys: list[str]) -> None:
        self._obstore.delete(self._store, keys)


def open_store(url: str) -> ObjectStore:
    """The store at `url` (see the module docstring); `ValueError` naming the URL for one it cannot open."""
    try:
        from obstore.store import LocalStore, S3Store, from_url
    except ImportError as error:
        raise ValueError(
            f"store_url {url} needs obstore: pip install 'hf_diloco[store]' (or pip install obstore)."
        ) from error
    shown = _without_credentials(url)
    scheme = urlsplit(url).scheme
    if scheme == "file":
        path = urlsplit(url).path
        if not path.startswith("/"):
            raise ValueError(f"store_url {shown}: a file:// URL needs an absolute path, e.g. file:///shared/job.")
        os.makedirs(path, exist_ok=True)
        return ObstoreStore(LocalStore(path, mkdir=True), shown)
    if scheme == "hf":
        match = re.fullmatch(r"hf://buckets/([^/]+)/([^/]+)(?:/(.*))?", url.rstrip("/"))
        if match is None:
            raise ValueError(f"store_url {shown}: a Hugging Face bucket is hf://buckets/OWNER/NAME[/PREFIX].")
        owner, name, prefix = match.groups()
        _need_s3_credentials(shown, "the S3 credentials of a Hugging Face token (Settings > Access Tokens > Generate "
                                    "S3 credentials)")  # fmt: skip
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or f"https://s3.hf.co/{owner}"
        store = S3Store(
            name, prefix=prefix or None, endpoint=endpoint, region=os.environ.get("AWS_REGION", "us-east-1"),
            virtual_hosted_style_request=False, client_options={"allow_http": endpoint.startswith("http://")},
        )  # fmt: skip
        return ObstoreStore(store, shown)
    if scheme in ("s3", "s3a"):
        _need_s3_credentials(shown, "the bucket's access keys")
    if scheme not in ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https"):
        raise ValueError(
            f"store_url {shown}: its scheme {scheme!r} is none of file://, s3://, hf://buckets/, gs://, az://."
        )
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    options = {"allow_http": True} if endpoint.startswith("http://") or scheme == "http" else {}
    try:
        return ObstoreStore(from_url(url, client_options=options), shown)
    except Exception as error:  # obstore's own errors for a URL or configuration it cannot use
        raise ValueError(f"store_url {shown} cannot be opened: {error}") from error


def _need_s3_credentials(shown: str, what: str) -> None:
    if not os.environ.get("AWS_ACCESS_KEY_ID") or not os.environ.get("AWS_SECRET_ACCESS_KEY"):
        raise ValueError(
            f"store_url {shown} needs {what} in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (environment variables, "
            "never a flag), and AWS_ENDPOINT_URL for a server other than AWS."
        )


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:
        parts = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))
    return urlunsplit(parts._replace(query=""))

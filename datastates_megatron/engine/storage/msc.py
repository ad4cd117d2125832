"""``msc://profile/path``: a multi-storage-client profile whose storage is S3 (or S3-compatible),
opened as an :class:`.s3.S3Storage` (docs/architecture.md, "Object storage": why not through MSC's
own client).

The profile is read from MSC's configuration file, found where MSC looks for it (``MSC_CONFIG``,
then ``$XDG_CONFIG_HOME/msc/``, ``~/.msc_config.*``, ``~/.config/msc/``, ``/etc/xdg/msc/``; YAML or
JSON), so a profile that works for Megatron-LM's ``--enable-msc`` works here.  From it:
``storage_provider.type`` (``s3`` or ``s8k``), its ``options`` ``base_path`` (``bucket[/prefix]``),
``endpoint_url``, ``region_name``, and a ``credentials_provider`` of type ``S3Credentials``
(``access_key``/``secret_key``/``session_token``; else the environment's).  Any other provider is
refused by name.  Credentials are handed to boto3 and scrubbed from every message.
"""

from __future__ import annotations

import json
import os

from .base import ObjectStorageError
from .url import StorageURL, parse_url

__all__ = ["open_msc", "msc_config_path", "S3_PROVIDERS"]

S3_PROVIDERS = ("s3", "s8k")  # MSC's S3 and S3-compatible (SwiftStack) providers


def msc_config_path() -> str | None:
    """The configuration file MSC itself would read, ``None`` when there is none."""
    env = os.environ.get("MSC_CONFIG")
    if env:
        return env
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME")
    dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    candidates = []
    if xdg:
        candidates += [os.path.join(xdg, "msc", "config.yaml"), os.path.join(xdg, "msc", "config.json")]
    candidates += [os.path.join(home, ".msc_config.yaml"), os.path.join(home, ".msc_config.json")]
    candidates += [
        os.path.join(home, ".config", "msc", "config.yaml"),
        os.path.join(home, ".config", "msc", "config.json"),
    ]
    for d in dirs:
        candidates += [os.path.join(d, "msc", "config.yaml"), os.path.join(d, "msc", "config.json")]
    return next((c for c in candidates if os.path.isfile(c)), None)


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ObjectStorageError(f"{path}: cannot read the MSC configuration: {e.strerror or e}") from e
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ObjectStorageError(f"{path}: the MSC configuration is not valid JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError as e:
            raise ObjectStorageError(
                f"{path}: reading a YAML MSC configuration needs pyyaml: pip install pyyaml"
            ) from e
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ObjectStorageError(f"{path}: the MSC configuration is not valid YAML") from None
    if not isinstance(doc, dict):
        raise ObjectStorageError(f"{path}: the MSC configuration is not a mapping")
    return doc


def open_msc(url: StorageURL, **options):
    """The :class:`.s3.S3Storage` of ``url``'s profile, ``url.prefix`` under the profile's base path."""
    from .s3 import S3Storage

    path = msc_config_path()
    if path is None:
        raise ObjectStorageError(
            f"{url}: no multi-storage-client configuration found (set MSC_CONFIG, or write ~/.msc_config.yaml)"
        )
    profile = _load(path).get("profiles", {}).get(url.bucket)
    if not isinstance(profile, dict):
        raise ObjectStorageError(f"{url}: {path} has no profile {url.bucket!r}")
    provider = profile.get("storage_provider") or {}
    kind = provider.get("type")
    if kind not in S3_PROVIDERS:
        raise ObjectStorageError(
            f"{url}: profile {url.bucket!r} uses storage provider {kind!r}; checkpoints on msc:// need an "
            f"S3-compatible one ({', '.join(S3_PROVIDERS)})"
        )
    opts = provider.get("options") or {}
    base = str(opts.get("base_path", "")).strip("/")
    if not base:
        raise ObjectStorageError(f"{url}: profile {url.bucket!r} has no options.base_path (bucket[/prefix])")
    s3url = parse_url(f"s3://{base}/{url.prefix}")
    creds = None
    cp = profile.get("credentials_provider")
    if isinstance(cp, dict) and cp.get("type") == "S3Credentials":
        o = cp.get("options") or {}
        creds = {
            "aws_access_key_id": o.get("access_key"),
            "aws_secret_access_key": o.get("secret_key"),
            "aws_session_token": o.get("session_token"),
        }
        creds = {k: os.path.expandvars(str(v)) for k, v in creds.items() if v}  # "${VAR}" as MSC writes them
    elif cp:
        kind = cp.get("type") if isinstance(cp, dict) else type(cp).__name__
        raise ObjectStorageError(f"{url}: profile {url.bucket!r}: credentials provider {kind!r} is not supported here")
    options.setdefault("endpoint_url", opts.get("endpoint_url"))
    options.setdefault("region", opts.get("region_name"))
    return S3Storage(s3url, credentials=creds, **options)

"""What needs no S3 server: object storage URLs, the config's rule for them, and the CRC32s of a
multipart object made from its parts' (the whole object's, combined; S3's composite)."""

from __future__ import annotations

import os
import zlib

import pytest

from datastates_megatron.engine.errors import OptionsError
from datastates_megatron.engine.storage.crc import composite_crc32, crc32_b64, crc32_from_b64, crc32_of_parts
from datastates_megatron.engine.storage.url import is_object_url, parse_url
from datastates_megatron.megatron.checkpointing.config import LazyCkptConfig


def test_crc32_of_parts_is_the_crc32_of_the_whole():
    parts = [os.urandom(n) for n in (0, 1, 4095, 5 << 20, 17)]
    assert crc32_of_parts([(zlib.crc32(p), len(p)) for p in parts]) == zlib.crc32(b"".join(parts))
    assert crc32_from_b64(crc32_b64(0xDEADBEEF)) == 0xDEADBEEF
    assert crc32_from_b64("abc-3") is None  # not base64 of 4 bytes


def test_composite_crc32_is_the_crc32_of_the_parts_crc32s():
    parts = [os.urandom(n) for n in (5 << 20, 5 << 20, 123)]
    crcs = [zlib.crc32(p) for p in parts]
    assert composite_crc32(crcs) == zlib.crc32(b"".join(c.to_bytes(4, "big") for c in crcs))
    assert composite_crc32(crcs) != zlib.crc32(b"".join(parts))
    # as S3 reports one: base64 of the 4 bytes, then "-" and the number of parts
    assert crc32_from_b64(f"{crc32_b64(composite_crc32(crcs))}-3") == composite_crc32(crcs)


def test_object_urls_are_told_from_paths():
    assert is_object_url("s3://b-1/x") and is_object_url("MSC://profile/x")
    assert not is_object_url("/lustre/s3://x") and not is_object_url("ckpt")
    assert parse_url("s3://bucket").prefix == ""


def test_a_save_dir_on_object_storage_takes_a_local_dir_or_none(tmp_path):
    assert LazyCkptConfig(save_dir="s3://bucket/run", host_cache_gb=1 / 1024).local_dir is None  # from memory
    with pytest.raises(OptionsError, match="promote_slots only applies to a local tier: it requires local_dir"):
        LazyCkptConfig(save_dir="s3://bucket/run", host_cache_gb=1 / 1024, promote_slots=4)
    cfg = LazyCkptConfig(save_dir="s3://bucket/run", local_dir=str(tmp_path), host_cache_gb=1 / 1024)
    assert cfg.effective_load_dir == "s3://bucket/run"

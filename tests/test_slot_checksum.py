"""Slot checksums: new slots carry CRC32C and say so (magic PHXSNAP2); slots and checkpoints written with the
old zlib CRC32 (PHXSNAP1, 7-field checkpoint headers) are verified with CRC32, never with the other algorithm;
an unknown format is refused with an error that names it."""
import zlib

import crc32c
import pytest

from phoenixrun.persist import CheckpointError, header_from_fields, parse_image
from phoenixrun.slot_format import HEADER_SIZE, SlotHeader, checksum, crc_private, crc_shared


def image(checksum_name: str, private: bytes = b"p" * 100, shared: bytes = b"s" * 300) -> bytearray:
    """A sealed slot image in the given algorithm."""
    h = SlotHeader(step=3, meta_cap=64, meta_len=2, private_len=len(private), shared_len=len(shared),
                   checksum=checksum_name)
    buf = bytearray(h.total_len)
    buf[HEADER_SIZE:HEADER_SIZE + 2] = b"{}"
    buf[h.private_off:h.private_off + len(private)] = private
    buf[h.shared_off:h.shared_off + len(shared)] = shared
    h = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, crc_private(buf, h),
                   crc_shared(buf, h), checksum_name)
    buf[:HEADER_SIZE] = h.pack()
    return buf


def test_new_slots_carry_crc32c_and_record_it_in_the_magic():
    buf = image(SlotHeader(0, 0, 0, 0, 0).checksum)
    h = SlotHeader.unpack(buf)
    assert bytes(buf[:8]) == b"PHXSNAP2" and h.checksum == "crc32c"
    assert h.crc_shared == crc32c.crc32c(bytes(buf[h.shared_off:h.shared_off + h.shared_len]))
    assert h.crc_shared != zlib.crc32(bytes(buf[h.shared_off:h.shared_off + h.shared_len]))


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
def test_each_format_verifies_with_its_own_algorithm_and_catches_a_flipped_byte(name):
    buf = image(name)
    h, meta = parse_image(buf)
    assert h.checksum == name and meta == {}
    for off in (h.private_off + 5, h.shared_off + 7, HEADER_SIZE + 1):   # private, shared, metadata
        bad = bytearray(buf)
        bad[off] ^= 0x01
        with pytest.raises(CheckpointError, match="fails its checksum"):
            parse_image(bad)


def test_legacy_slot_is_read_as_crc32():
    buf = image("crc32")
    assert bytes(buf[:8]) == b"PHXSNAP1" and SlotHeader.unpack(buf).checksum == "crc32"


def test_unknown_slot_format_is_refused_by_name():
    buf = image("crc32c")
    buf[:8] = b"PHXSNAP9"
    with pytest.raises(ValueError, match="PHXSNAP9.*another phoenixrun version"):
        SlotHeader.unpack(buf)
    buf[:8] = b"GARBAGE!"
    with pytest.raises(ValueError, match="bad magic"):
        SlotHeader.unpack(buf)


@pytest.mark.parametrize("fields, expected", [
    ([1, 64, 2, 100, 300, 11, 22], "crc32"),              # checkpoint written before the header named it
    ([1, 64, 2, 100, 300, 11, 22, "crc32"], "crc32"),
    ([1, 64, 2, 100, 300, 11, 22, "crc32c"], "crc32c"),
])
def test_checkpoint_header_fields(fields, expected):
    assert header_from_fields(fields).checksum == expected


def test_checkpoint_header_from_another_version_is_refused():
    with pytest.raises(CheckpointError, match="6 fields"):
        header_from_fields([1, 64, 2, 100, 300, 11])
    with pytest.raises(ValueError, match="unknown snapshot checksum 'xxh3'"):
        header_from_fields([1, 64, 2, 100, 300, 11, 22, "xxh3"])


def test_checksum_chains_like_one_pass():
    data = bytes(range(256)) * 40
    for name in ("crc32", "crc32c"):
        assert checksum(data[1000:], name, checksum(data[:1000], name)) == checksum(data, name)

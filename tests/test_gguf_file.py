"""Sluice's GGUF container reader against the ``gguf`` package's own ``GGUFReader``: every metadata
value type, arrays (nested too), tensors of several types behind a non-default alignment, and
clear refusals of truncated or foreign files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoints import write_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from worker.gguf.file import GGUFFile, GGUFFormatError


def _write_everything(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓ 日本")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "ü🎉", "<|im_end|>"])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    values = rng.normal(size=(4, 64)).astype(np.float32)
    writer.add_tensor("f32", values)
    writer.add_tensor("f16", values.astype(np.float16))
    writer.add_tensor("q8_0", quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("q4_0", quants.quantize(values[:1], Q.Q4_0), raw_dtype=Q.Q4_0)
    writer.add_tensor("vector", values[0, :3].copy())
    write_gguf(writer)
    return path


def test_metadata_and_tensors_read_as_gguf_reads_them(tmp_path: Path) -> None:
    path = _write_everything(tmp_path / "all.gguf")
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF.") and key != "t.nested":  # gguf flattens nested arrays (its FIXME)
            want = field.contents()
            assert ours.metadata[key] == want, key
            assert type(ours.metadata[key]) is type(want), key
    assert ours.metadata["t.nested"] == [[1, 2], [3]]
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(int(n) for n in reversed(t.shape.tolist()))
        np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    whole = _write_everything(tmp_path / "all.gguf").read_bytes()
    cases = {
        whole[:-100]: "runs past the end of the file",
        whole[:200]: "truncated at byte|runs past the end",
        b"GGUF" + (7).to_bytes(4, "little") + bytes(16): "GGUF version 7",
        b"PK\x03\x04 a zip file": "no GGUF magic",
    }
    for i, (data, reason) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=reason):
            GGUFFile(path)


def test_unknown_value_type_is_named(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    writer.add_key_value("t.odd", 1, GGUFValueType.UINT32)
    write_gguf(writer)
    raw = bytearray((tmp_path / "x.gguf").read_bytes())
    at = raw.index(b"t.odd") + len(b"t.odd")
    raw[at : at + 4] = (99).to_bytes(4, "little")  # the value's type
    (tmp_path / "x.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError, match="unknown metadata value type 99"):
        GGUFFile(tmp_path / "x.gguf")

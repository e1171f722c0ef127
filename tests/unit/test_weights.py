import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafaas.errors import MalformedModel
from lorafaas.formats.weights import read_safetensors_header


@pytest.fixture
def weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.float16)}, path)
    return path


def test_header_lists_tensors_with_offsets(weights_file: Path) -> None:
    header = read_safetensors_header(weights_file)
    assert header.tensors["a"].shape == (3, 4)
    assert header.tensors["a"].num_bytes == 48
    assert header.tensors["b"].dtype == "F16"
    assert header.num_parameters == 17
    raw = weights_file.read_bytes()
    b = header.tensors["b"]
    start = header.data_offset + b.begin
    assert torch.frombuffer(bytearray(raw[start : start + b.num_bytes]), dtype=torch.float16).tolist() == [1.0] * 5


def test_truncated_file_is_refused(weights_file: Path) -> None:
    weights_file.write_bytes(weights_file.read_bytes()[:-10])
    with pytest.raises(MalformedModel, match="truncated"):
        read_safetensors_header(weights_file)


def test_header_longer_than_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(MalformedModel, match="header claims 10000 bytes"):
        read_safetensors_header(path)


def test_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(MalformedModel, match="not valid JSON"):
        read_safetensors_header(path)


def test_offsets_inconsistent_with_shape_are_refused(tmp_path: Path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(MalformedModel, match="needs 16 bytes but its offsets span 8"):
        read_safetensors_header(path)

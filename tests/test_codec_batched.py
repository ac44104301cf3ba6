"""The quantised codec's records, encoded and decoded with a constant number of kernel calls,
match the same records made one by one with the reference kernels (what the codec did
before), on every backend that runs here, for odd sizes and both bit widths."""
from __future__ import annotations

import pytest
import torch

from overlap.kernels.backends import available_backends, get_backend
from overlap.runtime.compression import Compression, QuantizedCodec, RecordLayout

REFERENCE = get_backend("torch", torch.device("cpu"))
# (world, shard numel, block): shards that are whole blocks and shards that are not (odd).
SHAPES = [(2, 256, 128), (4, 128, 64), (5, 301, 64), (8, 37, 16), (3, 1, 2), (16, 130, 128)]
MODES = {8: "int8", 4: "int8-int4"}


def _backends() -> list[str]:
    return available_backends(torch.device("cpu"))


def _one_by_one_encode(source: torch.Tensor, wire: RecordLayout, rank: int, world: int,
                       error: torch.Tensor | None) -> torch.Tensor:
    send = torch.zeros(wire.nbytes * (world - 1), dtype=torch.uint8)
    quantize = REFERENCE.quantize_int8 if wire.bits == 8 else REFERENCE.quantize_int4
    for index, dest in enumerate(r for r in range(world) if r != rank):
        values, scales = wire.views(send, index)
        chunk_error = None if error is None else error.narrow(0, index * wire.numel, wire.numel)
        quantize(source.narrow(0, dest * wire.numel, wire.numel), values, scales, wire.block, chunk_error)
    return send


def _meaningful(records: torch.Tensor, wire: RecordLayout, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of every record but its padding (sent uninitialised)."""
    values, scales = wire.columns(records, count)
    return values.clone(), scales.clone()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world,shard,block", SHAPES)
def test_encode_chunks_matches_one_record_at_a_time(backend: str, bits: int, world: int, shard: int,
                                                    block: int) -> None:
    torch.manual_seed(world * 1000 + shard + bits)
    codec = QuantizedCodec(Compression(MODES[bits], block), get_backend(backend, torch.device("cpu")))
    wire = codec.reduce_format(shard)
    for rank in sorted({0, world // 2, world - 1}):
        source = torch.randn(world * shard) * 3
        source[shard // 2] = float("inf") if world > 2 else source[shard // 2]
        reduced_into = torch.zeros(shard)
        send = torch.full((wire.nbytes * (world - 1),), 0xAB, dtype=torch.uint8)   # poisoned
        error_before = None
        if codec.settings.error_feedback:
            error_before = torch.randn((world - 1) * shard) * 0.01
            codec._error_for(reduced_into, (world - 1) * shard, send.device).copy_(error_before)
        codec.encode_chunks(source, send, wire, rank, world, reduced_into)
        expected_error = None if error_before is None else error_before.clone()
        expected = _one_by_one_encode(source, wire, rank, world, expected_error)
        got_values, got_scales = _meaningful(send, wire, world - 1)
        want_values, want_scales = _meaningful(expected, wire, world - 1)
        assert torch.equal(got_values, want_values)
        torch.testing.assert_close(got_scales, want_scales, rtol=0, atol=0, equal_nan=True)
        if expected_error is not None:
            torch.testing.assert_close(codec._errors[reduced_into], expected_error, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world,shard,block", SHAPES)
def test_decodes_match_one_record_at_a_time(backend: str, bits: int, world: int, shard: int, block: int) -> None:
    torch.manual_seed(world * 7 + shard + bits)
    kernels = get_backend(backend, torch.device("cpu"))
    codec = QuantizedCodec(Compression(MODES[bits], block), kernels)
    wire = RecordLayout(shard, block, bits)
    records = torch.empty(wire.nbytes * world, dtype=torch.uint8)
    quantize = REFERENCE.quantize_int8 if bits == 8 else REFERENCE.quantize_int4
    for index in range(world):
        values, scales = wire.views(records, index)
        quantize(torch.randn(shard) * (index + 1), values, scales, block)

    # A gather's decode, into a poisoned buffer of a low-precision dtype.
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((world * shard,), float("nan"), dtype=dtype)
        codec.decode_gathered(out, records, wire, world)
        expected = torch.empty_like(out)
        for index in range(world):
            values, scales = wire.views(records, index)
            REFERENCE.dequantize_into(expected.narrow(0, index * shard, shard), values, scales, block, bits)
        assert torch.equal(out, expected)

    # A reduction's decode-accumulate: the same sum, in the chunked kernel's order.
    start = torch.randn(shard)
    target = start.clone()
    codec.decode_accumulate(target, records, wire, world)
    expected = start.clone()
    for index in range(world):
        values, scales = wire.views(records, index)
        REFERENCE.dequantize_accumulate(expected, values, scales, block, bits)
    torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-5)


class _Counting:
    """A kernel backend that counts the calls made through it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("shard,block", [(256, 128), (301, 64)])
def test_kernel_calls_do_not_grow_with_the_world(shard: int, block: int) -> None:
    """What the CPU can show of the launch count: the codec's kernel calls per collective are
    the same at 3 ranks and at 64 (each torch copy around them is one more launch, also a
    fixed number)."""
    calls = {}
    for world in (3, 64):
        kernels = _Counting(REFERENCE)
        codec = QuantizedCodec(Compression("int8-int4", block), kernels)
        wire = codec.reduce_format(shard)
        send = torch.empty(wire.nbytes * (world - 1), dtype=torch.uint8)
        codec.encode_chunks(torch.randn(world * shard), send, wire, world // 2, world, torch.zeros(shard))
        codec.decode_accumulate(torch.zeros(shard), send, wire, world - 1)
        gather = codec.gather_format(shard)
        codec.decode_gathered(torch.empty(world * shard), torch.zeros(gather.nbytes * world, dtype=torch.uint8),
                              gather, world)
        calls[world] = kernels.calls
    assert calls[3] == calls[64] <= 4

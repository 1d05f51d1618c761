"""The batched delta encoder writes exactly the reference encoder's bytes and the batched
decoder finds exactly the reference decoder's indices and errors, each with a fixed
number of host synchronizations. (``encode_delta`` and ``decode`` take the batched paths
on a GPU only; here they are called directly, on the CPU.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from dte_codec.decode import decode_batched, decode_per_entry
from dte_codec.encode import encode_delta_batched, encode_delta_per_tensor
from dte_codec.errors import CodecError, EncodeError
from dte_codec.fields import Body, Segments
from dte_codec.header import DTYPES, Header, ValueEncoding
from forge import redigest
from dte_codec.flat_values import resolve_residues
from dte_codec.indices import _bitmap, _elias_fano, _gap8, _raw, choose_indices, encode_indices
from dte_codec.values import decode_values
from hypothesis import example, given, note
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen
class Change:
    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


def _patterns(gen: torch.Generator, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs, infinities, -0 and subnormals included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * size,), generator=gen, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def _nearby(gen: torch.Generator, values: torch.Tensor, spread: int) -> torch.Tensor:
    """Bit patterns within ``spread`` ulps of ``values`` (bounds the residues often cover)."""
    if values.dtype == torch.bool:
        return values.clone()
    ints = values.view(INT_VIEWS[values.element_size()]).to(torch.int64)
    moved = ints + torch.randint(-spread, spread + 1, ints.shape, generator=gen)
    return moved.to(INT_VIEWS[values.element_size()]).view(values.dtype)


@st.composite
def tensor_and_change(draw) -> tuple[torch.Tensor, Change]:
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = draw(st.one_of(st.just(()), st.lists(st.integers(0, 70), min_size=1, max_size=3)
                           .map(tuple), st.sampled_from([(3000,), (70000,), (9, 400)])))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    numel = torch.Size(shape).numel()
    tensor = _patterns(gen, dtype, numel).reshape(shape)
    density = draw(st.sampled_from([0.0, 1e-4, 3e-3, 0.03, 0.3, 0.9, 1.0]))
    mask = torch.rand(numel, generator=gen) < density
    if numel and draw(st.booleans()):  # a run at one end makes long gaps and clusters
        mask[-(numel // 3 or 1):] = draw(st.booleans())
    indices = torch.nonzero(mask).view(-1).to(draw(st.sampled_from([torch.int32, torch.int64])))
    new = tensor.reshape(-1)[indices.long()]
    spread = draw(st.sampled_from([0, 1, 3, 200, 70000]))
    low = _nearby(gen, new, spread) if spread < 70000 else _patterns(gen, dtype, new.numel())
    high = low if draw(st.booleans()) else _nearby(gen, low, spread % 70000)
    return tensor, Change(indices, low, high)


@given(st.lists(tensor_and_change(), max_size=6))
@example([(torch.arange(600, dtype=torch.bfloat16),
           Change(torch.tensor([0, 299, 599]), *(torch.zeros(3, dtype=torch.bfloat16),) * 2))])
def test_flat_encoder_writes_the_reference_bytes(cases):
    """Over dtypes, shapes (0-d, empty), densities, gaps and bounds: byte-identical."""
    tensors = {f"t{i}": tensor for i, (tensor, _) in enumerate(cases)}
    changes = {f"t{i}": change for i, (_, change) in enumerate(cases)}
    expected = encode_delta_per_tensor(tensors, changes, stream_id="s", base_version=4,
                                       version=5)
    actual = encode_delta_batched(tensors, changes, stream_id="s", base_version=4, version=5)
    note(f"{expected.nbytes} vs {actual.nbytes} bytes")
    assert bytes(expected) == bytes(actual)


def _same_payload(expected, actual) -> None:
    assert expected.header == actual.header
    for want, got in zip(expected.indices, actual.indices, strict=True):
        if isinstance(want, torch.Tensor):
            assert want.tolist() == got.tolist()
        else:
            assert want == got
    assert [[s.tolist() for s in v] for v in expected.values] == [
        [s.tolist() for s in v] for v in actual.values]


@given(st.lists(tensor_and_change(), max_size=6))
def test_flat_decoder_finds_the_change_sets(cases):
    """Decoding a delta gives back every change set's indices, as the reference does."""
    tensors = {f"t{i}": tensor for i, (tensor, _) in enumerate(cases)}
    changes = {f"t{i}": change for i, (_, change) in enumerate(cases)}
    data = encode_delta_batched(tensors, changes, stream_id="s", base_version=4, version=5)
    payload = decode_batched(data)
    _same_payload(decode_per_entry(data), payload)
    for entry, where in zip(payload.header.entries, payload.indices):
        if isinstance(where, torch.Tensor):
            assert changes[entry.name].indices.tolist() == where.tolist()


@given(st.lists(tensor_and_change(), min_size=1, max_size=4), st.data())
def test_flat_decoder_rejects_what_the_reference_rejects(cases, data):
    """Body bytes overwritten (digest recomputed): the same error, or the same payload."""
    tensors = {f"t{i}": tensor for i, (tensor, _) in enumerate(cases)}
    changes = {f"t{i}": change for i, (_, change) in enumerate(cases)}
    payload = bytearray(bytes(encode_delta_batched(tensors, changes, stream_id="s",
                                                   base_version=4, version=5)))
    start = len(payload) - Header.unpack(memoryview(payload))[0].body_size()
    if start == len(payload):
        return
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(start, len(payload) - 1))
        payload[at] = data.draw(st.sampled_from([0, 1, 0x80, 0xFF, payload[at] ^ 1]))
    payload = redigest(payload)
    outcomes = []
    for decoder in (decode_per_entry, decode_batched):
        try:
            outcomes.append(decoder(payload))
        except CodecError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    if isinstance(outcomes[0], str) or isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1]
    else:
        _same_payload(*outcomes)


@given(st.lists(tensor_and_change(), min_size=1, max_size=4), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_flat_residues_resolve_as_the_reference(cases, inside, seed):
    """Against bases inside the bounds or arbitrary ones: the reference's values or error."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": tensor for i, (tensor, _) in enumerate(cases)}
    changes = {f"t{i}": change for i, (_, change) in enumerate(cases)}
    payload = decode_batched(encode_delta_batched(tensors, changes, stream_id="s",
                                                  base_version=4, version=5))
    picked = [(e, w, v) for e, w, v in zip(payload.header.entries, payload.indices,
                                           payload.values)
              if e.value_encoding == ValueEncoding.RESIDUE]
    if not picked:
        return
    bases = [changes[e.name].base_low if inside else _patterns(gen, e.dtype, e.count)
             for e, _, _ in picked]
    outcomes = []
    for resolve in (_reference_residues, _flat_residues):
        try:
            outcomes.append([v.view(INT_VIEWS[v.element_size()]).tolist()
                             for v in resolve(picked, bases)])
        except CodecError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


def _reference_residues(picked, bases):
    return [decode_values(e, v, b) for (e, _, v), b in zip(picked, bases)]


def _flat_residues(picked, bases):
    values, failures = resolve_residues([e for e, _, _ in picked], [v for _, _, v in picked],
                                        bases)
    return _reference_residues(picked, bases) if int(failures) else values


@given(count=st.integers(1, 5000), numel_shift=st.integers(0, 40),
       escapes=st.integers(0, 5000))
def test_closed_form_index_choice_matches_the_candidates(count, numel_shift, escapes):
    """``choose_indices`` picks what building every candidate picks, up to 2**40 elements."""
    numel = count + (count << numel_shift)
    escapes = min(escapes, count)
    gaps = torch.ones(count, dtype=torch.int64)
    gaps[:escapes] = numel // count  # > 255 once numel // count is
    big = int((gaps > 255).sum())
    indices = torch.cumsum(gaps, 0) - 1
    # the encoder before the closed form: build every candidate, keep the first smallest
    candidates = [_raw(indices, numel), _gap8(indices, numel), _elias_fano(indices, numel)]
    if numel <= 8 * candidates[0].size:
        candidates.append(_bitmap(indices, numel))
    expected = min(candidates, key=lambda c: c.size)
    chosen = choose_indices(count, numel, gap_escapes=big)
    assert expected.encoding == encode_indices(indices, numel).encoding
    assert (expected.encoding, expected.width, expected.escapes) == (
        chosen["index_encoding"], chosen.get("index_width", 0), chosen.get("index_escapes", 0))


@pytest.mark.parametrize("indices", [[3, 1], [0, 0], [-1, 2], [0, 8]])
def test_bad_change_set_raises_the_reference_error(indices):
    """A change set that does not fit its tensor raises what the reference raises."""
    tensors = {"ok": torch.zeros(4), "w": torch.zeros(8)}
    low = torch.zeros(2)
    changes = {"ok": Change(torch.tensor([1]), low[:1], low[:1]),
               "w": Change(torch.tensor(indices), low, low)}
    messages = []
    for encoder in (encode_delta_per_tensor, encode_delta_batched):
        with pytest.raises(EncodeError) as info:
            encoder(tensors, changes, stream_id="s", base_version=0, version=1)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


class _HostReads(TorchFunctionMode):
    """Counts the calls that make the host wait for a device: reads of values
    (``item``, ``tolist``, ``int``/``bool``/``float``, ``numpy``), copies to the host, and
    ops whose output size depends on values (``nonzero``, boolean-mask indexing, ...)."""

    READS = {"item", "tolist", "__int__", "__bool__", "__float__", "__index__", "numpy", "cpu"}
    SIZED = {"nonzero", "unique", "bincount", "masked_select", "argwhere"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS | self.SIZED:
            self.calls.append(name)
        if name in ("__getitem__", "__setitem__") and _bool_index(args[1]):
            self.calls.append(name + "[mask]")
        if name == "repeat_interleave" and "output_size" not in kwargs:
            self.calls.append(name)
        return func(*args, **kwargs)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.mark.parametrize("tensors", [1, 40])
def test_two_host_reads_per_payload(tensors):
    """Encoding reads the device twice, for 1 or 40 tensors: the statistics (``cpu``, then
    ``tolist`` on the host) and the body digest (``int``); the body stays where it is."""
    gen = torch.Generator().manual_seed(tensors)
    weights = {f"w{i}": torch.randn(5000, generator=gen).to(torch.bfloat16)
               for i in range(tensors)}
    changes = {name: Change(torch.arange(0, 5000, 37), *(w[::37].clone(),) * 2)
               for name, w in weights.items()}
    with _HostReads() as reads:
        encode_delta_batched(weights, changes, stream_id="s", base_version=0, version=1)
    assert ["cpu", "tolist", "__int__"] == reads.calls


@pytest.mark.parametrize("tensors", [1, 40])
def test_two_host_reads_per_decode(tensors):
    """Decoding a frame reads the device twice (the body digest, then the failed-check
    count), for 1 or 40 tensors."""
    gen = torch.Generator().manual_seed(tensors)
    weights = {f"w{i}": torch.randn(5000, generator=gen).to(torch.bfloat16)
               for i in range(tensors)}
    changes = {name: Change(torch.arange(i % 3, 5000, 37 + i), *(w[i % 3::37 + i].clone(),) * 2)
               for i, (name, w) in enumerate(weights.items())}
    data = encode_delta_batched(weights, changes, stream_id="s", base_version=0, version=1)
    with _HostReads() as reads:
        decode_batched(data)
    assert ["__int__", "__int__"] == reads.calls


@given(st.lists(st.integers(0, 40), min_size=1, max_size=300), st.integers(0, 2**31 - 1))
def test_runs_add_what_index_add_adds(words, seed):
    """The GPU path of ``Body.write`` (one add per run of equal words) adds the same words
    as a plain ``index_add_``, runs split or not."""
    gen = torch.Generator().manual_seed(seed)
    word = torch.tensor(words)
    bits = torch.randint(-2**62, 2**62, word.shape, generator=gen)
    body = Body(41 * 8, word.numel(), torch.device("cpu"))
    body._add_runs(word, bits, torch.arange(word.numel()) + 41)
    expected = torch.zeros(41, dtype=torch.int64).index_add_(0, word, bits)
    assert expected.tolist() == body.bytes().view(torch.int64).tolist()


@given(st.lists(st.integers(0, 30), max_size=8), st.integers(0, 2**31 - 1))
def test_histogram_counts_per_segment(counts, seed):
    """``Segments.histogram`` on the CPU equals per-bin prefix-sum counts (its GPU path),
    values outside the bins not counted."""
    gen = torch.Generator().manual_seed(seed)
    segs = Segments.of(counts, torch.device("cpu")) if counts else None
    if segs is None or not segs.total:
        return
    values = torch.randint(-1, 7, (segs.total,), generator=gen)
    expected = torch.stack([segs.sums(values == b) for b in range(5)], 1)
    assert expected.tolist() == segs.histogram(values, 5).tolist()

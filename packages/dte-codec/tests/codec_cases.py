"""Change-set strategies and the batched-against-reference checks shared by the flat
(torch) and the kernel tests: each check runs the batched path on ``device`` and the
per-tensor reference on the CPU, and asserts equal bytes, indices, values or errors."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import note
from hypothesis import strategies as st

from dte_codec import apply_
from dte_codec.decode import decode_batched, decode_per_entry, decode_queued
from dte_codec.encode import encode_delta_per_tensor
from dte_codec.encodings import DTYPES, ValueEncoding
from dte_codec.errors import CodecError, DigestError
from dte_codec.flat_decode import decode_indices_flat
from dte_codec.flat_encode import encode_delta_flat
from dte_codec.flat_values import resolve_residues
from dte_codec.frame import Frame
from dte_codec.header import Header
from forge import redigest
from dte_codec.values import decode_values
from torch.overrides import TorchFunctionMode

INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen
class Change:
    indices: torch.Tensor
    base_low: torch.Tensor
    base_high: torch.Tensor


def patterns(gen: torch.Generator, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs, infinities, -0 and subnormals included)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * size,), generator=gen, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def nearby(gen: torch.Generator, values: torch.Tensor, spread: int) -> torch.Tensor:
    """Bit patterns within ``spread`` ulps of ``values`` (bounds the residues often cover)."""
    if values.dtype == torch.bool:
        return values.clone()
    ints = values.view(INT_VIEWS[values.element_size()]).to(torch.int64)
    moved = ints + torch.randint(-spread, spread + 1, ints.shape, generator=gen)
    return moved.to(INT_VIEWS[values.element_size()]).view(values.dtype)


LARGE_SHAPES = ((3000,), (70000,), (9, 400))


@st.composite
def tensor_and_change(draw, *, largest: int = 70**3) -> tuple[torch.Tensor, Change]:
    """A tensor and a change set of it, of at most ``largest`` elements (Triton's
    interpreter runs kernels as numpy per program, so its cost grows with the elements:
    its multi-block structures come from the kernel tests' explicit examples)."""
    fits = lambda shape: torch.Size(shape).numel() <= largest  # noqa: E731
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = draw(st.one_of(st.just(()), st.lists(st.integers(0, 70), min_size=1, max_size=3)
                           .map(tuple).filter(fits),
                           st.sampled_from([s for s in LARGE_SHAPES if fits(s)])))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    numel = torch.Size(shape).numel()
    tensor = patterns(gen, dtype, numel).reshape(shape)
    density = draw(st.sampled_from([0.0, 1e-4, 3e-3, 0.03, 0.3, 0.9, 1.0]))
    mask = torch.rand(numel, generator=gen) < density
    if numel and draw(st.booleans()):  # a run at one end makes long gaps and clusters
        mask[-(numel // 3 or 1):] = draw(st.booleans())
    indices = torch.nonzero(mask).view(-1).to(draw(st.sampled_from([torch.int32, torch.int64])))
    new = tensor.reshape(-1)[indices.long()]
    spread = draw(st.sampled_from([0, 1, 3, 200, 70000]))
    low = nearby(gen, new, spread) if spread < 70000 else patterns(gen, dtype, new.numel())
    high = low if draw(st.booleans()) else nearby(gen, low, spread % 70000)
    return tensor, Change(indices, low, high)


def named(cases, device="cpu") -> tuple[dict, dict]:
    """``(tensors, changes)`` by name, on ``device``."""
    tensors = {f"t{i}": tensor.to(device) for i, (tensor, _) in enumerate(cases)}
    changes = {f"t{i}": Change(*(x.to(device) for x in attrs.astuple(change)))
               for i, (_, change) in enumerate(cases)}
    return tensors, changes


def _encode(cases) -> bytes:
    """The reference's payload bytes (the batched encoders write the same bytes)."""
    return bytes(encode_delta_per_tensor(*named(cases), stream_id="s", base_version=4,
                                         version=5))


def assert_encoders_agree(cases, device) -> None:
    """The batched encoder on ``device`` writes the reference's bytes, itself (valid
    change sets never send it down the reference path)."""
    expected = _encode(cases)
    tensors, changes = named(cases, device)
    actual = encode_delta_flat(tensors, changes, stream_id="s", base_version=4, version=5)
    note(f"{len(expected)} vs {actual.nbytes} bytes")
    assert expected == bytes(actual)


def assert_queued_digest_compared(cases, bit: int, device) -> None:
    """The batched encoder's frame on ``device`` leaves its body digest queued
    (``Frame.pending_digest``), its bytes the reference's once read; with that digest one
    bit off, every decoder refuses the body (``DigestError``), where the flat decoder
    compares it on the device."""
    tensors, changes = named(cases, device)
    frame = encode_delta_flat(tensors, changes, stream_id="s", base_version=4, version=5)
    if frame.pending_digest is None:  # nothing changed: an empty body, sealed at once
        assert not frame.body_size
        return
    flipped = frame.pending_digest ^ (torch.ones_like(frame.pending_digest) << bit)
    tampered = Frame(frame.head, frame.segments, pending_digest=flipped)
    assert _encode(cases) == bytes(frame)
    for decoder in (decode_per_entry, decode_batched, lambda f: decode_queued(f).settled()):
        with pytest.raises(DigestError, match="body_digest"):
            decoder(tampered)
        decoder(frame)


def assert_stale_escapes_refused(monkeypatch, encoder: type, device) -> None:
    """A flat encoder (of type ``encoder`` on ``device``) writes only with the escape
    ranks it counted itself: ``count_escapes`` made to hand back the first sync's ranks,
    the second sync's ``write`` refuses them instead of writing with them."""
    values = torch.zeros(3, dtype=torch.bfloat16)
    cases = [(torch.arange(600, dtype=torch.bfloat16),
              Change(torch.tensor([0, 299, 599]), values, values))]
    tensors, changes = named(cases, device)
    count, counted = encoder.count_escapes, []

    def first_sync_ranks(self, choice):
        counted.append(count(self, choice))
        return counted[0]
    monkeypatch.setattr(encoder, "count_escapes", first_sync_ranks)
    expected = _encode(cases)
    first = encode_delta_flat(tensors, changes, stream_id="s", base_version=4, version=5)
    assert expected == bytes(first)
    with pytest.raises(AssertionError, match="escapes counted by another encoder"):
        encode_delta_flat(tensors, changes, stream_id="s", base_version=4, version=5)


def same_payload(expected, actual) -> None:
    assert expected.header == actual.header
    for want, got in zip(expected.indices, actual.indices, strict=True):
        if isinstance(want, torch.Tensor):
            assert want.tolist() == got.tolist()
        else:
            assert want == got
    assert [[s.tolist() for s in v] for v in expected.values] == [
        [s.tolist() for s in v] for v in actual.values]


def assert_decoders_agree(cases, device) -> None:
    """The batched decoder on ``device`` finds every change set's indices, as the
    reference does."""
    data = _encode(cases)
    payload = decode_batched(data, device=device)
    same_payload(decode_per_entry(data), payload)
    frame = Frame.from_bytes(data).to(device)
    header = Header.unpack_head(memoryview(frame.header), frame.body_size)
    flat = decode_indices_flat(header, frame.body())
    assert 0 == int(flat.failures)  # found by the batched decoder itself, not its fallback
    sparse = [w for w in payload.indices if isinstance(w, torch.Tensor)]
    assert [w.tolist() for w in sparse] == [w.tolist() for w in flat.indices]
    _, changes = named(cases)
    for entry, where in zip(payload.header.entries, payload.indices):
        if isinstance(where, torch.Tensor):
            assert changes[entry.name].indices.tolist() == where.tolist()


def assert_corrupt_decodes_agree(cases, data, device) -> None:
    """Body bytes overwritten (digest recomputed): the same error, or the same payload."""
    payload = bytearray(_encode(cases))
    start = len(payload) - Header.unpack(memoryview(payload))[0].body_size()
    if start == len(payload):
        return
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(start, len(payload) - 1))
        payload[at] = data.draw(st.sampled_from([0, 1, 0x80, 0xFF, payload[at] ^ 1]))
    assert_same_outcome(redigest(payload), device)


def assert_same_outcome(payload: bytes | bytearray, device) -> None:
    """The batched decoder on ``device`` raises the reference's error, or decodes the
    reference's payload."""
    outcomes = []
    for decoder, where in ((decode_per_entry, "cpu"), (decode_batched, device)):
        try:
            outcomes.append(decoder(payload, device=where))
        except CodecError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    if isinstance(outcomes[0], str) or isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1]
    else:
        same_payload(*outcomes)


def assert_residues_agree(cases, inside: bool, seed: int, device) -> None:
    """Against bases inside the bounds or arbitrary ones: the reference's values or
    error."""
    gen = torch.Generator().manual_seed(seed)
    _, changes = named(cases)
    payload = decode_batched(_encode(cases), device=device)
    picked = [(e, w, v) for e, w, v in zip(payload.header.entries, payload.indices,
                                           payload.values)
              if e.value_encoding == ValueEncoding.RESIDUE]
    if not picked:
        return
    bases = [changes[e.name].base_low if inside else patterns(gen, e.dtype, e.count)
             for e, _, _ in picked]
    if inside:  # every residue resolves: the batched resolver reports no failure
        _, failures = resolve_residues([e for e, _, _ in picked],
                                       [v for _, _, v in _to(picked, device)],
                                       [b.to(device) for b in bases])
        assert 0 == int(failures)
    outcomes = []
    for resolve, where in ((_reference_residues, "cpu"), (_flat_residues, device)):
        try:
            outcomes.append([v.view(INT_VIEWS[v.element_size()]).tolist()
                             for v in resolve(_to(picked, where), [b.to(where) for b in bases])])
        except CodecError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]


def _to(picked, device):
    return [(e, w, tuple(s.to(device) for s in v)) for e, w, v in picked]


def _reference_residues(picked, bases):
    return [decode_values(e, v, b) for (e, _, v), b in zip(picked, bases)]


def _flat_residues(picked, bases):
    values, failures = resolve_residues([e for e, _, _ in picked], [v for _, _, v in picked],
                                        bases)
    return _reference_residues(picked, bases) if int(failures) else values


def assert_apply_agrees(cases, device) -> None:
    """``apply_`` on ``device`` writes what the reference writes onto the receiver's base
    (the bounds' low end at the changed elements): the sender's tensors, bit for bit."""
    tensors, changes = named(cases)
    data = _encode(cases)
    bases = {}
    for name, tensor in tensors.items():
        base = tensor.clone().reshape(-1)
        base[changes[name].indices.long()] = changes[name].base_low
        bases[name] = base.reshape(tensor.shape)
    expected = {name: base.clone() for name, base in bases.items()}
    apply_(expected, decode_per_entry(data))
    actual = {name: base.to(device) for name, base in bases.items()}
    apply_(actual, decode_batched(data, device=device))
    for name, tensor in tensors.items():
        bits = INT_VIEWS[tensor.element_size()]
        got = actual[name].cpu().view(bits).tolist()
        assert tensor.view(bits).tolist() == got
        assert expected[name].view(bits).tolist() == got


class HostReads(TorchFunctionMode):
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

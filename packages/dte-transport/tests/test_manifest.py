"""Manifest of a staged version: JSON round trip, strict parsing, the current chain."""

import json

import pytest
from dte_transport.errors import ManifestError
from dte_transport.manifest import Manifest, StagedFile, StoredKind, current_chain
from hypothesis import given
from hypothesis import strategies as st

counts = st.integers(0, 2**63 - 1)
hexes = st.text("0123456789abcdef", min_size=32, max_size=32)
names = st.text(min_size=1).filter(lambda n: "/" not in n and "\\" not in n
                                   and not n.startswith("."))


@st.composite
def manifests(draw):
    kind = draw(st.sampled_from(StoredKind))
    return Manifest(sequence=draw(counts), stream_id=draw(st.text()), version=draw(counts),
                    kind=kind,
                    base_version=draw(counts) if kind is StoredKind.DELTA else None,
                    files=tuple(draw(st.lists(st.builds(StagedFile, name=names, size=counts,
                                                        xxh3_128=hexes), max_size=3))),
                    tensors=draw(st.dictionaries(st.text(), hexes, max_size=3)))


def manifest(sequence, version, kind=StoredKind.DELTA, *, stream="s", base=None):
    if kind is StoredKind.DELTA and base is None:
        base = version - 1
    return Manifest(sequence=sequence, stream_id=stream, version=version, kind=kind,
                    base_version=base, files=(), tensors={})


@given(manifests())
def test_json_round_trip(original):
    """Every manifest parses back to itself."""
    assert original == Manifest.from_json(original.to_json(), file="m")


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": "sparse"}, "kind: expected ['full', 'anchor', 'delta'], got 'sparse'"),
    ({"base_version": 3}, "base_version: expected None, got 3"),
    ({"version": -1}, "version: expected an int >= 0, got -1"),
    ({"sequence": True}, "sequence: expected an int >= 0, got True"),
    ({"files": [{"name": "../x", "size": 1, "xxh3_128": "0"}]},
     "files: expected a list of {name, size, xxh3_128}, got [{'name': '../x', 'size': 1, "
     "'xxh3_128': '0'}]"),
    ({"stream_id": None}, "stream_id: expected a string, got None"),
])
def test_invalid_fields_are_named(change, message):
    """A manifest field of the wrong kind is named with what was expected and got."""
    doc = json.loads(manifest(1, 1, StoredKind.FULL).to_json())
    with pytest.raises(ManifestError) as raised:
        Manifest.from_json(json.dumps({**doc, **change}).encode(), file="000000000001.json")
    assert f"manifest '000000000001.json': {message}" == str(raised.value)


def test_missing_field_and_bad_json_are_named():
    """A manifest without a field, or not JSON at all, is an error naming the file."""
    doc = json.loads(manifest(1, 1, StoredKind.FULL).to_json())
    del doc["tensors"]
    errors = []
    for raw in (json.dumps(doc).encode(), b"{"):
        with pytest.raises(ManifestError) as raised:
            Manifest.from_json(raw, file="m")
        errors.append(str(raised.value))
    assert ["manifest 'm': tensors: expected an object of digests, got nothing",
            "manifest 'm': json: expected a JSON object, got Expecting property name enclosed "
            "in double quotes: line 1 column 2 (char 1)"] == errors


def test_chain_starts_at_the_latest_full_version():
    """Older versions before the latest full one (not yet pruned) are not in the chain."""
    listed = [manifest(1, 1, StoredKind.FULL), manifest(2, 2), manifest(3, 3, StoredKind.ANCHOR),
              manifest(4, 4)]
    assert [listed[2], listed[3]] == current_chain(listed)


def test_chain_with_a_gap_is_an_error():
    """A delta that is not onto the version before it breaks the chain, by name."""
    with pytest.raises(ManifestError) as raised:
        current_chain([manifest(1, 1, StoredKind.FULL), manifest(2, 3, base=2)])
    assert ("manifest '000000000002.manifest.json': base_version: expected 1, got 2"
            == str(raised.value))

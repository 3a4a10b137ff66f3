"""The error tree (protocol.errors): abstract base, h11 split, structured fields."""

from __future__ import annotations

import pytest

from protocol import codec
from protocol.errors import (
    IncompatibleVersion,
    InvalidDelta,
    LocalProtocolError,
    MalformedMessage,
    ProtocolError,
    RemoteProtocolError,
)
from protocol.messages import DeltaBody, Hello
from protocol.state import ReplicaState
from worker_side.replica import check_hello


def test_protocol_error_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        ProtocolError("boom")
    with pytest.raises(TypeError):
        ProtocolError("boom", seq=3)


def test_hierarchy_splits_local_and_remote() -> None:
    for cls in (MalformedMessage, IncompatibleVersion, InvalidDelta):
        assert issubclass(cls, RemoteProtocolError)
        assert not issubclass(cls, LocalProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(ProtocolError, Exception)


@pytest.mark.parametrize("cls", [LocalProtocolError, RemoteProtocolError, MalformedMessage,
                                 InvalidDelta])
def test_fields_appear_in_str(cls: type[ProtocolError]) -> None:
    err = cls("bad thing", seq=7, handles=[1, 2])
    assert str(err) == "bad thing (seq=7, handles=[1, 2])"
    assert err.fields == {"seq": 7, "handles": [1, 2]}
    assert err.message == "bad thing"
    assert str(cls("plain")) == "plain"


def test_incompatible_version_fields() -> None:
    err = IncompatibleVersion("other major", ours=1, theirs=2)
    assert (err.ours, err.theirs) == (1, 2)
    assert str(err) == "other major (ours=1, theirs=2)"


def test_raised_errors_carry_their_fields() -> None:
    with pytest.raises(IncompatibleVersion) as hello:
        check_hello(Hello(epoch=1, seq=0, major=99))
    assert "theirs=99" in str(hello.value)
    with pytest.raises(MalformedMessage) as bad:
        codec.decode([b"\xc1"])
    assert "cause=" in str(bad.value)
    with pytest.raises(InvalidDelta) as mismatch:
        ReplicaState().apply(DeltaBody(), expected_digest=1)
    assert mismatch.value.fields == {"expected": 1, "got": 0}
    with pytest.raises(LocalProtocolError) as local:
        ReplicaState(token_mode=5)
    assert "token_mode=5" in str(local.value)


def test_the_core_raises_typed_errors_with_fields() -> None:
    """Major 3's core: a spec that does not decode is MalformedMessage (its cause named),
    a body that does not fit the state InvalidDelta, a step that does not fit the
    mirror LocalProtocolError -- each with the fields that say why."""
    import msgspec

    from engine_side.mirror import EngineMirror
    from protocol.messages import NewRequest
    from protocol.packing import pack_uints

    not_a_spec = DeltaBody(added=(NewRequest(handle=0, spec=msgspec.Raw(b"\x01")),))
    with pytest.raises(MalformedMessage) as bad:
        ReplicaState().apply(not_a_spec)
    assert "ValidationError" in str(bad.value.fields["cause"])
    with pytest.raises(InvalidDelta) as unfit:
        ReplicaState().apply(DeltaBody(finished=pack_uints([3])))
    assert "finished" in unfit.value.message
    with pytest.raises(LocalProtocolError) as local:
        EngineMirror().step(["x"], [1, 2])
    assert local.value.fields


def test_a_snapshot_naming_a_negative_handle_is_refused_typed() -> None:
    """Found by the fuzz campaign: a handle below 0 reached the packer (ValueError)."""
    import msgspec
    from test_golden import golden_messages

    from protocol.errors import InvalidDelta
    from protocol.messages import Snapshot
    from protocol.snapshot import load_snapshot

    snap = golden_messages()["snapshot"]
    assert isinstance(snap, Snapshot)
    first = msgspec.structs.replace(snap.body.requests[0], handle=-1)
    body = msgspec.structs.replace(snap.body, requests=(first, *snap.body.requests[1:]),
                                   blocks=())
    bad = codec.decode(codec.encode(msgspec.structs.replace(snap, body=body)))
    with pytest.raises(InvalidDelta):
        load_snapshot(bad)  # type: ignore[arg-type]  # (a Snapshot: bad on purpose)
    assert load_snapshot(snap).digest == snap.digest

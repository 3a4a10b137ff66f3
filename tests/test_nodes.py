"""The node layout of a multi-node DeltaExecutor and the remote rank's hello (no vLLM
needed; the end-to-end runs are tests/test_vllm_nodes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_side.keys import write_keys
from engine_side.vllm.nodes import LayoutError, NodeLayout
from engine_side.vllm.remote import layout_for
from protocol.calls import HELLO_FIELDS, pack_hello, parse_hello
from protocol.errors import MalformedMessage

HELLO = {"node": "1", "vllm": "0.32.0", "protocol": "3", "config": "ab12"}


def test_hello_round_trips_and_names_exactly_its_fields() -> None:
    assert parse_hello(pack_hello(**HELLO)) == HELLO
    with pytest.raises(ValueError):
        pack_hello(**{**HELLO, "extra": "x"})


@given(st.binary(max_size=600) | st.builds(lambda d: str(d).encode(), st.dictionaries(
    st.sampled_from([*HELLO_FIELDS, "other"]), st.text(max_size=300) | st.integers())))
def test_any_bytes_are_a_hello_or_malformed(payload: bytes) -> None:
    try:
        fields = parse_hello(payload)
    except MalformedMessage:
        return
    assert sorted(fields) == sorted(HELLO_FIELDS)
    assert all(isinstance(v, str) and len(v) <= 256 for v in fields.values())


def test_a_hello_with_a_wrong_field_is_malformed() -> None:
    for bad in (b"", b"[]", b'{"node": 1}', pack_hello(**HELLO)[:-1],
                b'{"node": "1", "vllm": "x", "protocol": "3", "config": 7}'):
        with pytest.raises(MalformedMessage):
            parse_hello(bad)


def _layout(keys: Path, **changed: Any) -> NodeLayout:
    extra = {"deltacast_nnodes": 2, "deltacast_master_addr": "10.0.0.1",
             "deltacast_master_port": 29500, "deltacast_keys": str(keys), **changed}
    return NodeLayout.from_config(extra, world_size=4)


def test_layout_places_ranks_and_ports_by_node(tmp_path: Path) -> None:
    write_keys(tmp_path / "k", 1)
    layout = _layout(tmp_path / "k")
    assert NodeLayout.from_config({}, 4) == NodeLayout() and not NodeLayout().remote
    assert layout.remote and layout.per_node(4) == 2
    assert [layout.node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert layout.channel(1) == "tcp://10.0.0.1:29501"
    assert layout.init_method == "tcp://10.0.0.1:29500"
    public, secret, allowed = layout.node_keys()
    assert len(public) == len(secret) == 40 and list(allowed) == [1]


@pytest.mark.parametrize(("changed", "says"), [
    ({"deltacast_nnodes": 3}, "does not divide the world size 4"),
    ({"deltacast_nnodes": 0}, "positive integer"),
    ({"deltacast_master_addr": ""}, "needs deltacast_master_addr"),
    ({"deltacast_master_port": 65535}, "must be a port in 1..65533"),
    ({"deltacast_keys": "/nonexistent"}, "deltacast keys DIR --workers 1"),
])
def test_layout_errors_say_what_to_fix(tmp_path: Path, changed: dict[str, Any],
                                       says: str) -> None:
    write_keys(tmp_path / "k", 1)
    with pytest.raises(LayoutError, match=says):
        _layout(tmp_path / "k", **changed)


def test_a_missing_node_key_is_named(tmp_path: Path) -> None:
    write_keys(tmp_path / "k", 1)
    with pytest.raises(LayoutError, match="worker2.key is missing: node 2 joins"):
        NodeLayout.from_config({"deltacast_nnodes": 4, "deltacast_master_addr": "h",
                                "deltacast_master_port": 1000,
                                "deltacast_keys": str(tmp_path / "k")}, 4).node_keys()


def test_a_placement_other_than_ray_is_refused() -> None:
    with pytest.raises(LayoutError, match='deltacast_placement must be "ray"'):
        layout_for({"deltacast_placement": "k8s"}, 2)


def test_ray_placement_without_a_cluster_says_how_to_start_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'deltacast[ray]')")
    import ray
    from ray._private.services import find_gcs_addresses

    if ray.is_initialized() or find_gcs_addresses():
        pytest.skip("a Ray cluster runs on this machine")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(LayoutError, match="ray start --head"):
        layout_for({"deltacast_placement": "ray"}, 2)


def test_free_ports_are_consecutive_and_bindable() -> None:
    import socket

    from engine_side.vllm.ray_nodes import free_ports

    first = free_ports("127.0.0.1", 3)
    held = [socket.socket() for _ in range(3)]
    try:
        for port, s in enumerate(held, start=first):
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_a_rank_that_does_not_exit_after_the_engines_restart_is_stopped() -> None:
    """The node's supervision (``deltacast node``) of real processes: a rank hung in a
    step never reads the engine's restart; JOIN_S after the relay passed it on, the node
    stops its ranks and starts them again.  Ranks that exit cleanly end it with 0."""
    import multiprocessing
    import time

    from worker_side.vllm import node

    ctx = multiprocessing.get_context("spawn")
    hung = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    done = ctx.Process(target=time.sleep, args=(0,), daemon=True)
    hung.start()
    done.start()
    try:
        assert node._supervise([done], [3], lambda: None) == 0
        told = [None, None, time.monotonic() - node.JOIN_S - 1]  # said, past JOIN_S
        started = time.monotonic()
        assert node._supervise([hung], [2], lambda: told.pop(0) if len(told) > 1
                               else told[0]) == node.RESTART
        assert hung.is_alive() and time.monotonic() - started < 5  # (its caller kills it)
    finally:
        hung.kill()
        hung.join()
        done.join()

"""The communicator registry (docs/API.md "Communicators by axis name"): `communicators(...)`
blocks, `register` / `find` / `close_all`, the errors when none or two match."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import _registry
from conftest import make_mesh

SMALL = dict(max_message_bytes=1 << 16)


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    nvc.close_all()


def test_communicators_one_per_mesh_axis_closed_on_exit():
    mesh = make_mesh((2, 4), ("a", "b"))
    with nvc.communicators(mesh, **SMALL) as comms:
        assert set(comms) == {"a", "b"}
        assert comms["a"].world_size == 2 and comms["b"].world_size == 4
        assert _registry.find("a", what="t") is comms["a"]
        assert _registry.find("b", what="t") is comms["b"]
        assert _registry.find(("b",), what="t") is comms["b"]
    assert all(c.closed for c in comms.values())
    with pytest.raises(ValueError, match=r"no Communicator for axis_name 'a'; "
                                         r"none is registered"):
        _registry.find("a", what="t")


def test_missing_axis_names_the_axes_that_have_one():
    mesh = make_mesh((2, 4), ("a", "b"))
    with nvc.communicators(mesh, axes="b", **SMALL):
        with pytest.raises(ValueError) as e:
            _registry.find("a", what="all_reduce")
        msg = str(e.value)
        assert "all_reduce" in msg and "'a'" in msg and "kind=" not in msg
        assert "axes that have one: 'b'" in msg
        with pytest.raises(ValueError, match=r"no MoECommunicator for axis_name "
                                             r"'b'; none is registered"):
            _registry.find("b", kind="moe", what="moe_dispatch")


def test_bad_kind_and_axis_types():
    with pytest.raises(ValueError, match="kind must be 'tp' or 'moe', got 'ep'"):
        _registry.find("a", kind="ep", what="t")
    with pytest.raises(TypeError, match="axis_name must be a str or a non-empty tuple of str, "
                                        "got 3"):
        _registry.find(3, what="t")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        with nvc.communicators("mesh"):
            pass


def test_innermost_block_wins_and_outer_comes_back():
    mesh = make_mesh((8,), ("x",))
    with nvc.communicators(mesh, **SMALL) as outer:
        with nvc.communicators(mesh, max_message_bytes=1 << 17) as inner:
            assert _registry.find("x", what="t") is inner["x"]
        assert inner["x"].closed and not outer["x"].closed
        assert _registry.find("x", what="t") is outer["x"]


def test_pool_register_unregister_and_ambiguity():
    mesh = make_mesh((8,), ("x",))
    c1 = nvc.Communicator(mesh, "x", **SMALL)
    c2 = nvc.Communicator(mesh, "x", **SMALL)
    _registry.register(c1)
    _registry.register(c1)  # twice: a no-op
    assert _registry.find("x", what="t") is c1
    _registry.register(c2)
    with pytest.raises(ValueError, match=r"t: axis_name 'x' is ambiguous: Communicator over "
                                         r"\('x',\).*Communicator over \('x',\)"):
        _registry.find("x", what="t")
    _registry.unregister(c1)
    assert _registry.find("x", what="t") is c2
    # a block shadows the pool
    with nvc.communicators(mesh, **SMALL) as b:
        assert _registry.find("x", what="t") is b["x"]
    assert _registry.find("x", what="t") is c2
    nvc.close_all()
    assert c2.closed and not c1.closed  # c1 was unregistered: not closed by close_all
    c1.close()


def test_closed_communicators_are_not_found():
    mesh = make_mesh((8,), ("x",))
    c = nvc.Communicator(mesh, "x", **SMALL)
    _registry.register(c)
    c.close()
    with pytest.raises(ValueError, match="none is registered"):
        _registry.find("x", what="t")


def test_close_all_closes_block_communicators():
    mesh = make_mesh((2, 4), ("a", "b"))
    with nvc.communicators(mesh, **SMALL) as comms:
        nvc.close_all()
        assert all(c.closed for c in comms.values())
        with pytest.raises(ValueError, match="none is registered"):
            _registry.find("a", what="t")


def test_moe_kind_is_its_own():
    mesh = make_mesh((4,), ("ep",))
    moe = nvc.MoECommunicator(mesh, "ep", num_experts=8, top_k=2, max_tokens=8, hidden=16,
                              dtype=jnp.float32)
    _registry.register(moe)
    assert _registry.find("ep", kind="moe", what="t") is moe
    with pytest.raises(ValueError, match=r"no Communicator for axis_name 'ep'"):
        _registry.find("ep", what="t")
    with pytest.raises(ValueError, match=r"do not fit this call"):
        _registry.find("ep", kind="moe", what="t", accept=lambda c: c.hidden == 32)
    nvc.close_all()
    assert moe.closed


def test_inside_shard_map_the_mesh_picks():
    """Two meshes with the same axis name but different sizes: inside a shard_map the one of
    the surrounding mesh is found."""
    m8 = make_mesh((8,), ("x",))
    m4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    c8 = nvc.Communicator(m8, "x", **SMALL)
    c4 = nvc.Communicator(m4, "x", **SMALL)
    _registry.register(c8)
    _registry.register(c4)
    seen = {}

    def body(x):
        seen["c"] = _registry.find("x", what="t")
        return x

    jax.jit(jax.shard_map(body, mesh=m4, in_specs=P("x"), out_specs=P("x")))(jnp.ones(4))
    assert seen["c"] is c4
    jax.jit(jax.shard_map(body, mesh=m8, in_specs=P("x"), out_specs=P("x")))(jnp.ones(8))
    assert seen["c"] is c8


def test_failed_creation_closes_what_was_made():
    mesh = make_mesh((2, 4), ("a", "b"))
    with pytest.raises(ValueError, match="axis_name 'z' is not an axis of the mesh"):
        with nvc.communicators(mesh, axes=["a", "z"], **SMALL):
            pass
    assert _registry.registered() == []

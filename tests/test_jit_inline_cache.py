"""`nvc.jit(f, **kw)(x)` written inline at every call finds what its first call traced and
compiled, as `jax.jit(f, **kw)(x)` does: one program per (function, jit arguments), the
function held weakly (functools.partial by its function and arguments, bound methods by
their object). Counted by how often the function's Python body runs (each trace runs it)."""
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))


def _psum_fn(mesh, counter, scale=1.0):
    def f(x):
        counter.append(1)  # runs once per trace
        return jax.shard_map(lambda a: jax.lax.psum(a * scale, "x"), mesh=mesh,
                             in_specs=P("x"), out_specs=P())(x)
    return f


def _x(rng, rows=16, cols=32):
    return jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)


def test_inline_calls_trace_once_and_agree_with_jax_jit(rng):
    traced = []
    f = _psum_fn(_mesh(), traced)
    x = _x(rng)
    want = jax.jit(f, donate_argnums=())(x)
    nvc.jit(f, donate_argnums=())(x)
    after_first = len(traced)
    for _ in range(5):
        got = nvc.jit(f, donate_argnums=())(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(traced) == after_first
    assert nvc.jit(f, donate_argnums=())._program is nvc.jit(f, donate_argnums=())._program
    # other jit arguments: a program of their own, traced again
    nvc.jit(f, donate_argnums=(0,))(_x(rng))
    assert len(traced) > after_first
    assert nvc.jit(f, donate_argnums=(0,))._program is not nvc.jit(f)._program
    # a new input signature traces again under the same program, as jax.jit does
    n = len(traced)
    nvc.jit(f, donate_argnums=())(_x(rng, cols=64))
    assert len(traced) > n


def test_equal_partials_share_a_program_and_other_arguments_do_not(rng):
    traced = []
    mesh = _mesh()

    def g(x, scale):
        traced.append(1)
        return jax.shard_map(lambda a: jax.lax.psum(a * scale, "x"), mesh=mesh,
                             in_specs=P("x"), out_specs=P())(x)

    x = _x(rng)
    first = nvc.jit(functools.partial(g, scale=2.0))(x)
    n = len(traced)
    again = nvc.jit(functools.partial(g, scale=2.0))(x)
    assert len(traced) == n
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    other = nvc.jit(functools.partial(g, scale=3.0))(x)
    assert len(traced) > n
    np.testing.assert_array_equal(np.asarray(other),
                                  np.asarray(jax.jit(functools.partial(g, scale=3.0))(x)))


def test_an_unhashable_partial_argument_still_runs_correctly(rng):
    traced = []
    mesh = _mesh()

    def g(x, w):
        traced.append(1)
        return jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P())(x) * w

    x, w = _x(rng), np.asarray(rng.standard_normal(32), np.float32)
    want = jax.jit(functools.partial(g, w=w))(x)
    for _ in range(2):
        got = nvc.jit(functools.partial(g, w=w))(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class _Layer:
    def __init__(self, mesh, scale, counter):
        self.mesh, self.scale, self.counter = mesh, scale, counter

    def forward(self, x):
        self.counter.append(1)
        return jax.shard_map(lambda a: jax.lax.psum(a * self.scale, "x"), mesh=self.mesh,
                             in_specs=P("x"), out_specs=P())(x)


def test_bound_methods_are_keyed_by_their_object(rng):
    traced = []
    a, b = _Layer(_mesh(), 2.0, traced), _Layer(_mesh(), 3.0, traced)
    x = _x(rng)
    nvc.jit(a.forward)(x)
    n = len(traced)
    ya = nvc.jit(a.forward)(x)
    assert len(traced) == n
    yb = nvc.jit(b.forward)(x)            # another object: its own program
    assert len(traced) > n
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(jax.jit(a.forward)(x)))
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(jax.jit(b.forward)(x)))


def test_the_cache_holds_functions_and_objects_weakly(rng):
    x = _x(rng)
    f = _psum_fn(_mesh(), [])
    nvc.jit(f, donate_argnums=())(x)
    layer = _Layer(_mesh(), 2.0, [])
    nvc.jit(layer.forward)(x)
    nvc.jit(functools.partial(layer.forward))(x)
    dead_f, dead_layer = weakref.ref(f), weakref.ref(layer)
    del f, layer
    gc.collect()
    assert dead_f() is None
    assert dead_layer() is None


def test_a_held_jitted_keeps_its_function(rng):
    x = _x(rng)
    g = nvc.jit(_psum_fn(_mesh(), []))   # the lambda-like function lives only in g
    gc.collect()
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(g(x)))

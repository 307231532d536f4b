"""The dropless EP MoE layer on ragged_all_to_all (jax_nvcomm/models/moe_ragged.py) and its
runner (examples/moe_ragged.py) on CPU devices: the forward pass and the training step's loss
and gradients (weights, tokens) of the sharded layer, with XLA's collectives (lax; on CPU
jax_nvcomm.reference's emulation of ragged_all_to_all) and with jax_nvcomm's, against a dense
pure-JAX version of the same layer written here (one device, no exchange, every expert on
every token, einsum); routing balanced, all onto one rank's experts (its receive buffer full),
top-k = all experts, one device."""
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm.models import moe_ragged as mr

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "moe_ragged.py"


def _dense_loss(params, x, target, top_k):
    """The layer's definition on global arrays: softmax router, top-k renormalised, SwiGLU
    experts silu(x Wg) * (x Wu) Wd, output = sum over the top-k of weight * expert(x); the
    loss sum((y - target)^2) / tokens. Returns (loss, y)."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    w, ids = jax.lax.top_k(probs, top_k)
    w = w / w.sum(-1, keepdims=True)
    gate = jnp.zeros(probs.shape).at[jnp.arange(x.shape[0])[:, None], ids].set(w)
    h = jax.nn.silu(jnp.einsum("nh,ehf->enf", x, params["w_gate"])) * \
        jnp.einsum("nh,ehf->enf", x, params["w_up"])
    y = jnp.einsum("ne,enh->nh", gate, jnp.einsum("enf,efh->enh", h, params["w_down"]))
    return jnp.sum((y - target) ** 2) / x.shape[0], y


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _data(rng, n, hidden, experts, ffn, hot=0):
    """float32 numpy weights and tokens; hot > 0: every token's top choices are experts
    0 .. hot-1 (a large shared input feature the router reads for them only)."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    p = dict(router=f(hidden, experts) / hidden ** 0.5,
             w_gate=f(experts, hidden, ffn) / hidden ** 0.5,
             w_up=f(experts, hidden, ffn) / hidden ** 0.5,
             w_down=f(experts, ffn, hidden) / ffn ** 0.5)
    x = f(n, hidden)
    if hot:
        x[:, 0] = 4.0
        p["router"][0, :] = 0.0
        p["router"][0, :hot] = 3.0 + np.arange(hot, 0, -1)  # distinct: no ties among them
    return p, x, f(n, hidden)


@pytest.mark.parametrize("world,experts,top_k,hot,impl", [
    (8, 16, 4, 0, "lax"),
    (8, 16, 4, 0, "nvc"),
    (8, 32, 4, 4, "nvc"),   # every token to rank 0's 4 experts: rank 0's buffer full
    (2, 4, 4, 0, "nvc"),    # top-k = every expert, more than a rank's 2 experts
    (1, 8, 2, 0, "nvc"),
])
def test_layer_and_training_step_match_dense(rng, world, experts, top_k, hot, impl):
    devs = jax.devices()[:world]
    if len(devs) < world:
        pytest.skip(f"needs {world} devices")
    n, hidden, ffn, axis = 8 * world, 32, 16, "ep"
    p_np, x_np, t_np = _data(rng, n, hidden, experts, ffn, hot)
    mesh = jax.sharding.Mesh(np.array(devs), (axis,))
    specs = mr.param_specs(axis)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p_np.items()}
    x, target = (jax.device_put(a, NamedSharding(mesh, P(axis))) for a in (x_np, t_np))

    comm = nvc.Communicator(mesh, axis, max_message_bytes=mr.comm_bytes(
        n // world, top_k, experts, world, hidden, jnp.float32)) if impl == "nvc" else None
    try:
        coll = mr.collectives(impl, axis_name=axis, comm=comm)
        fwd = lambda x, p: mr.moe_layer(x, p, top_k=top_k, axis_name=axis, coll=coll)  # noqa
        step = lambda p, x, t: mr.loss_and_grads(fwd, p, x, t, axis_name=axis,  # noqa: E731
                                                 psum=coll.psum, num_tokens=n)
        y = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(P(axis), specs),
                                  out_specs=P(axis)))(x, params)
        loss, grads, dx = jax.jit(jax.shard_map(
            step, mesh=mesh, in_specs=(specs, P(axis), P(axis)),
            out_specs=(P(), specs, P(axis))))(params, x, target)
        jax.block_until_ready((y, loss, grads, dx))  # before the communicator closes
    finally:
        if comm is not None:
            comm.close()

    (want_loss, want_y), (want_g, want_dx) = jax.value_and_grad(
        _dense_loss, argnums=(0, 1), has_aux=True)(p_np, x_np, t_np, top_k)
    if hot:  # the routing really is all onto rank 0's experts
        ids = np.asarray(jax.lax.top_k(x_np @ p_np["router"], top_k)[1])
        assert (np.sort(ids, -1) == np.arange(top_k)).all()
    assert np.abs(np.asarray(want_y)).max() > 0.1
    assert _rel(y, want_y) < 1e-5
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert _rel(dx, want_dx) < 1e-4
    for k in p_np:
        assert np.abs(np.asarray(want_g[k])).max() > 0, k
        assert _rel(grads[k], want_g[k]) < 1e-4, k


def test_collectives_switch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="impl must be one of"):
        mr.collectives("nccl", axis_name="ep")
    with pytest.raises(ValueError, match="needs comm"):
        mr.collectives("nvc", axis_name="ep")


def _example():
    spec = importlib.util.spec_from_file_location("moe_ragged_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = ["--tokens", "64", "--hidden", "32", "--experts", "16", "--top-k", "4", "--ffn", "16",
         "--iters", "1"]


def test_example_runs_both_impls_and_a_stored_reference(tmp_path, capsys):
    """The runner on 8 CPU devices: lax, nvc and the dense reference agree (it says which
    emulation stands in for lax on CPU); the lax results stored on one device compare with
    an nvc-only run on 8; a reference of another model is refused."""
    ex = _example()
    ref = str(tmp_path / "ref.npz")
    assert ex.main(SMALL + ["--devices", "1", "--impl", "lax", "--save-ref", ref]) == 0
    assert ex.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "jax_nvcomm.reference's emulation" in out
    assert "CPU devices: these timings mean nothing for GPUs" in out  # the CPU caveat
    for pair in ("nvc vs lax", "lax vs dense", "nvc vs dense"):
        assert f"{pair}: max" in out, pair
    assert "DISAGREE" not in out and out.count(": agree") == 4  # lax vs dense twice
    assert ex.main(SMALL + ["--impl", "nvc", "--ref", ref]) == 0
    out = capsys.readouterr().out
    assert "nvc vs the reference: " in out and "DISAGREE" not in out
    assert "lax :" not in out  # nvc only: no XLA collective ran
    assert ex.main(SMALL[2:] + ["--tokens", "128", "--impl", "nvc", "--ref", ref]) == 2
    assert "holds another model" in capsys.readouterr().err


def test_worst_case_buffers_on_a_default_communicator(rng):
    """MaxText's sizing (receive buffer = local rows x min(EP, E / top_k) = W * T * min(K, L)
    rows) beyond a default Communicator's max_message_bytes (36 MiB of float32 rows > 32 MiB):
    the layer runs our kernels end to end (the chunked path: chunk_bytes > 0 in the program, no
    XLA collective), forward and training step, every token onto rank 0's experts (its buffer
    full), against the dense layer; the communicator's memory unchanged."""
    world, experts, top_k, T, hidden, ffn, axis = 8, 64, 8, 64, 2304, 8, "ep"
    devs = jax.devices()[:world]
    n = T * world
    p_np, x_np, t_np = _data(rng, n, hidden, experts, ffn, hot=top_k)
    mesh = jax.sharding.Mesh(np.array(devs), (axis,))
    specs = mr.param_specs(axis)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p_np.items()}
    x, target = (jax.device_put(a, NamedSharding(mesh, P(axis))) for a in (x_np, t_np))
    rows = mr.capacity(T, top_k, experts, world)
    assert rows == T * top_k * min(world, experts // top_k)     # MaxText's worst case
    with nvc.Communicator(mesh, axis) as comm:
        assert rows * hidden * 4 > comm.max_message_bytes
        nbytes = comm.nbytes
        coll = mr.collectives("nvc", axis_name=axis, comm=comm)
        fwd = lambda x, p: mr.moe_layer(x, p, top_k=top_k, axis_name=axis, coll=coll)  # noqa
        step = lambda p, x, t: mr.loss_and_grads(fwd, p, x, t, axis_name=axis,  # noqa: E731
                                                 psum=coll.psum, num_tokens=n)
        f_fwd = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(P(axis), specs),
                                      out_specs=P(axis)))
        f_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(axis), P(axis)),
                                       out_specs=(P(), specs, P(axis))))
        for hlo in (f_fwd.lower(x, params).as_text(),
                    f_step.lower(params, x, target).as_text()):
            chunks = re.findall(r"custom_call @nvc_ragged_all_to_all\(.*?chunk_bytes = (\d+)",
                                hlo)
            assert chunks and max(int(c) for c in chunks) > 0, chunks
            assert "all-to-all" not in hlo and "all-gather" not in hlo
        y = f_fwd(x, params)
        loss, grads, dx = f_step(params, x, target)
        jax.block_until_ready((y, loss, grads, dx))
        assert comm.nbytes == nbytes and not comm.errors()
    (want_loss, want_y), (want_g, want_dx) = jax.value_and_grad(
        _dense_loss, argnums=(0, 1), has_aux=True)(p_np, x_np, t_np, top_k)
    ids = np.asarray(jax.lax.top_k(x_np @ p_np["router"], top_k)[1])
    assert (np.sort(ids, -1) == np.arange(top_k)).all()          # all onto rank 0's experts
    assert _rel(y, want_y) < 1e-5
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert _rel(dx, want_dx) < 1e-4
    for k in p_np:
        assert _rel(grads[k], want_g[k]) < 1e-4, k

"""Processes passing different Communicator arguments get a ValueError naming the argument."""
import jax

from common import init, mesh1d, rank_print

nvc = init()
mesh = mesh1d()
mb = (1 << 20) if jax.process_index() == 0 else (2 << 20)
try:
    nvc.Communicator(mesh, "x", max_message_bytes=mb)
except ValueError as e:
    assert "max_message_bytes" in str(e), str(e)
    rank_print("GOT ValueError:", e)
else:
    raise SystemExit("expected a ValueError")

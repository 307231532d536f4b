"""Launcher behaviour probe: --mode=ok (print env), fail (rank 1 exits 3), hang (rank 1 sleeps)."""
import os
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
rank = int(os.environ["JAX_PROCESS_ID"])
print(f"env {os.environ['JAX_NUM_PROCESSES']} {rank} {os.environ['JAX_COORDINATOR_ADDRESS']}",
      flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "hang" and rank == 1:
    time.sleep(600)
if mode in ("fail", "hang"):
    time.sleep(600 if rank == 0 else 0)  # rank 0 would wait forever: the launcher must end it

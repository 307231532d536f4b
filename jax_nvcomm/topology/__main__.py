"""`python -m jax_nvcomm.topology`: this process's CUDA devices (name, PCI bus id, SMs,
multicast support, UUID) and the link of every pair (nvlink, pcie, none), then the same as one
JSON line. On a machine without NVIDIA GPUs it says so and exits 0: there is nothing to report
(jax_nvcomm runs its host backend on CPU devices there). Exit 1: GPUs are present but their
facts cannot be read (cuda-python missing, or the driver failing), with the reason."""
from __future__ import annotations

import argparse
import json
import sys

from .._platform import nvidia_gpus
from . import report


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m jax_nvcomm.topology", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rep = report()
    if "error" in rep:
        gpus = nvidia_gpus()
        if not gpus:
            print(f"host {rep['host']}: no NVIDIA GPU (nvidia-smi -L lists none): no CUDA facts "
                  "to report; jax_nvcomm runs its host backend on CPU devices here")
            return 0
        print(f"host {rep['host']}: {len(gpus)} NVIDIA GPU(s) listed by nvidia-smi, but their "
              f"facts cannot be read: {rep['error']}", file=sys.stderr)
        return 1
    print(f"host {rep['host']}: {len(rep['devices'])} CUDA device(s)")
    for d in rep["devices"]:
        print(f"  GPU {d['ordinal']}: {d['name']}  pci {d['pci_bus_id']}  SMs {d['sm_count']}  "
              f"multicast {'yes' if d['multicast_supported'] else 'no'}  uuid {d['uuid']}")
    for pair, link in rep["links"].items():
        print(f"  link {pair}: {link}")
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())

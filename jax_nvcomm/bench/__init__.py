"""Benchmarks of jax_nvcomm against XLA's collectives, `python -m jax_nvcomm.bench SUBCOMMAND`:

  allreduce  all_reduce / all_reduce_rms_norm / all_reduce_rms_norm_quant against lax.psum
             (+ XLA's add + RMSNorm) over message sizes (loop benchmark)
  moe        moe_dispatch / moe_combine against the XLA references (loop)
  varlen     all_gather_v / reduce_scatter_v against padded all_gather and zero-filled psum
             (loop)
  ragged     ragged_all_to_all against lax.ragged_all_to_all at MoE shapes, balanced and
             skewed routing (loop)
  moelayer   an MoE layer's expert compute at decode shapes on one device: nvc.ragged_dot
             against lax.ragged_dot, each row with its weight-read bound
  step       whole jitted model steps of the example model, jax_nvcomm against XLA, with the
             no-communication bound
  inline     the per-call cost of jax_nvcomm.jit(f, **kw)(x) written inline (made anew at
             each call) against the same inline jax.jit
  compile    compile time (trace + lower + compile) of dense layers sharded by type, nvc.jit
             against jax.jit, and their ratio

Runs on every device of the job: one process driving all local devices (mesh over
`jax.devices()`), or the processes of `python -m jax_nvcomm.launch -n N` (rank 0 reports).
Without a GPU it runs on 8 CPU devices; the numbers then only show that the code runs.

Timing is done on the device, not from Python: one jitted program runs the op
1 + unroll x steps times (once, then an unrolled block inside a `lax.fori_loop`), each call
consuming the previous call's result:
  - all-reduce: the output is the next input (no extra pass over the data; XLA's all-reduce
    simplifier, which would fold psum(psum(x)) into a multiply, is off for these programs);
  - MoE: one row of the output goes into the next call's input (a one-row update), the
    routing moves by one expert per call (ids + 1 mod E), and every call's full outputs stay
    live in the loop's carried values;
  - the values carried from call to call pass through `lax.optimization_barrier`,
so XLA can neither merge, drop, hoist, partially compute nor fuse together any calls (the
optimised program's op counts are saved as `hlo_ops` in the JSON). The program runs `reps`
times; each run gives one per-call time = wall time / calls. Reported: median, p10 and p90
over the runs, in microseconds per call. The host's launch cost of one run (tens of us on a
GPU machine) is spread over all calls of that run.

Device time (`--device-time {auto,on,off}`, auto = on for GPUs): after the timed runs, a
profiler trace of 2 more runs of the program (every process runs them,
process 0 records into a temporary directory deleted afterwards); the sum of device 0's kernel
durations in the last run / calls is the row's `device_us` (with `device_kernels_per_call` and
`device_top`, the kernels that took most time), shown as "dN" after the loop time in the
tables. It counts the loop's own small kernels (row updates, loop control) too, and none of
the gaps between kernels. None (with `device_note`) when the trace has no device kernels, as on
CPU devices.

This module is not imported by the package (`import jax_nvcomm` does not load it).
"""

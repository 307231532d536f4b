"""Example models built on jax_nvcomm (not imported by `import jax_nvcomm`): moe_transformer, the
MoE transformer of `python -m jax_nvcomm.demo` and `bench step`;
typed_decoder, dense decoder layers sharded by type (`bench compile`)."""

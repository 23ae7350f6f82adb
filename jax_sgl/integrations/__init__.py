"""Adapters that let serving engines run on jax_sgl's kernels.

Each adapter is its own module and imports its engine only when that module is imported
(`import jax_sgl.integrations.sglang_jax`): `import jax_sgl` never pulls an engine in, and no
engine is a dependency of jax_sgl.
"""

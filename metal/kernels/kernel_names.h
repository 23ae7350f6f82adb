// The names of every Metal kernel jax_sgl ships, in one place: the .metal instantiation blocks,
// the macOS host glue and the Linux emulator all expand these lists, so a name can never be
// spelled two ways. Each X(...) entry is one instantiation; dtype tags are f32/f16/bf16, index
// tags i32/i64.
#pragma once

// rope_pool: X(dtype_tag, index_tag)
#define JAX_SGL_ROPE_POOL_KERNELS(X) \
  X(f32, i32) X(f32, i64) X(f16, i32) X(f16, i64) X(bf16, i32) X(bf16, i64)
#define JAX_SGL_ROPE_POOL_KERNEL_NAME(t, i) "jax_sgl_rope_pool_" #t "_" #i

// attention forward and the clear kernel for varlen rows no sequence covers: X(dtype_tag)
#define JAX_SGL_ATTENTION_KERNELS(X) X(f32) X(f16) X(bf16)
#define JAX_SGL_ATTENTION_FWD_KERNEL_NAME(t) "jax_sgl_attention_fwd_" #t
#define JAX_SGL_ATTENTION_CLEAR_KERNEL_NAME(t) "jax_sgl_attention_clear_" #t

// Tag -> Metal storage type (kernels) ...
#define JAX_SGL_METAL_TYPE_f32 float
#define JAX_SGL_METAL_TYPE_f16 half
#define JAX_SGL_METAL_TYPE_bf16 bfloat
#define JAX_SGL_METAL_TYPE_i32 int
#define JAX_SGL_METAL_TYPE_i64 long
// ... and -> jax_sgl::DType / IndexType (host).
#define JAX_SGL_METAL_DTYPE_f32 ::jax_sgl::DType::kF32
#define JAX_SGL_METAL_DTYPE_f16 ::jax_sgl::DType::kF16
#define JAX_SGL_METAL_DTYPE_bf16 ::jax_sgl::DType::kBF16
#define JAX_SGL_METAL_ITYPE_i32 ::jax_sgl::IndexType::kI32
#define JAX_SGL_METAL_ITYPE_i64 ::jax_sgl::IndexType::kI64

"""GPU smoke check of every det_matmul kernel path; prints one line per case (never stops early)."""

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import det_matmul
from jaxrl_kernels.gemm.reference import matmul_reference


def case(name, fn):
  try:
    msg = fn()
    print(f"OK   {name}: {msg}", flush=True)
  except Exception as e:  # noqa: BLE001 - a smoke report
    tb = traceback.format_exc().strip().splitlines()
    print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}\n    " + "\n    ".join(tb[-6:]),
          flush=True)


def acc(impl, m, k, n, dtype=jnp.bfloat16, transpose_b=False, out_dtype=None):
  def f():
    a = jax.random.normal(jax.random.key(0), (m, k)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, k) if transpose_b else (k, n)).astype(dtype)
    out = det_matmul(a, b, transpose_b=transpose_b, out_dtype=out_dtype, implementation=impl)
    ref = matmul_reference(a, b, transpose_b=transpose_b)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    single = det_matmul(a[m - 1:], b, transpose_b=transpose_b, out_dtype=out_dtype,
                        implementation=impl)
    inv = np.array_equal(np.asarray(single).view(np.uint8), np.asarray(out[m - 1:]).view(np.uint8))
    return f"rel_err={err:.2e} last-row-invariant={inv}"
  return f


def grad(impl, m, k, n, transpose_b=False):
  def f():
    a = jax.random.normal(jax.random.key(0), (m, k)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, k) if transpose_b else (k, n)).astype(
        jnp.bfloat16)
    g = jax.grad(lambda a, b: det_matmul(a, b, transpose_b=transpose_b, implementation=impl)
                 .astype(jnp.float32).sum(), argnums=(0, 1))(a, b)
    r = jax.grad(lambda a, b: jnp.dot(a.astype(jnp.float32), (b.T if transpose_b else b)
                                      .astype(jnp.float32)).sum(), argnums=(0, 1))(a, b)
    return " ".join(f"{float(jnp.linalg.norm(x.astype(jnp.float32) - y) / jnp.linalg.norm(y)):.2e}"
                    for x, y in zip(g, r))
  return f


if __name__ == "__main__":
  print(jax.__version__, jax.devices())
  for impl in ("mosaic", "triton"):
    case(f"{impl} 256x512x1024", acc(impl, 256, 512, 1024))
    case(f"{impl} 1x4096x4096", acc(impl, 1, 4096, 4096))
    case(f"{impl} 1000x1000x1032 (ragged)", acc(impl, 1000, 1000, 1032))
    case(f"{impl} 300x512x640 transpose_b", acc(impl, 300, 512, 640, transpose_b=True))
    case(f"{impl} 4096x4096x4096 out f32", acc(impl, 4096, 4096, 4096, out_dtype=jnp.float32))
    case(f"{impl} fp16 512x512x512", acc(impl, 512, 512, 512, dtype=jnp.float16))
    case(f"{impl} grad 300x512x640", grad(impl, 300, 512, 640))
    case(f"{impl} grad 300x512x640 transpose_b", grad(impl, 300, 512, 640, transpose_b=True))
  case("triton fp32 512x512x512", acc("triton", 512, 512, 512, dtype=jnp.float32))

"""Multi-process runs on JAX's distributed runtime (``jaxrl_kernels.distributed``): worker
processes on localhost with gloo collectives, each owning a slice of one global mesh, give
the same bits as one process with a mesh of the same shape, and as the unsharded ops.

On a CPU machine nothing here skips: one where no port can be bound or gloo cannot start
fails. The ``gpu`` test launches one process per GPU (2 GPUs needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax
import multiprocess_worker as worker
import numpy as np
import pytest
from helpers import assert_bitwise_equal, bits, rel_err

from jaxrl_kernels import distributed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
CASES = "kernels,model,moe"


def _worker_cmd(process_id: int, num_processes: int, port: int, *, local_devices: int | None,
                axes: str, cases: str, out, join_timeout_s: int) -> list[str]:
  cmd = [sys.executable, WORKER, "--process-id", str(process_id), "--num-processes",
         str(num_processes), "--port", str(port), "--axes", axes, "--cases", cases, "--out",
         str(out), "--timeout", str(join_timeout_s)]
  return cmd + ([] if local_devices is None else ["--local-devices", str(local_devices)])


def _gpu_env(i: int) -> dict[str, str]:
  # One GPU per process; the test process holds the GPUs too, so no preallocation.
  return {**os.environ, "JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": str(i),
          "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def launch(cases: str, *, num_processes: int, local_devices: int | None, axes: str, tmp_path,
           gpu: bool = False, timeout_s: int = 300, join_timeout_s: int = 60
           ) -> dict[str, np.ndarray]:
  """Runs ``num_processes`` workers (CPU: ``local_devices`` each; ``gpu``: one GPU each);
  returns process 0's outputs (``"case/name"`` keys). On any failure the test fails with
  every process's output. A port taken between :func:`free_port` and the coordinator's
  start is retried with a new port (twice)."""
  for attempt in range(3):
    port = distributed.free_port()
    out = tmp_path / f"run{attempt}.npz"
    logs = [tmp_path / f"run{attempt}-p{i}.log" for i in range(num_processes)]
    procs = []
    for i, log in enumerate(logs):
      with open(log, "w") as f:
        procs.append(subprocess.Popen(
            _worker_cmd(i, num_processes, port, local_devices=local_devices, axes=axes,
                        cases=cases, out=out, join_timeout_s=join_timeout_s),
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=_gpu_env(i) if gpu else ENV))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
      try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        timed_out = True
        break
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    texts = [log.read_text() for log in logs]
    if not timed_out and all(p.returncode == 0 for p in procs):
      with np.load(out) as z:
        return dict(z)
    if "which is already in use on this host" in texts[0] and attempt < 2:
      continue
    report = "\n".join(f"--- process {i} (exit {p.returncode}):\n{t[-4000:]}"
                       for i, (p, t) in enumerate(zip(procs, texts, strict=True)))
    what = f"timed out after {timeout_s}s" if timed_out else "failed"
    pytest.fail(f"{num_processes}-process run of {cases!r} on {axes} {what}:\n{report}")
  raise AssertionError("unreachable")


def single_process(cases: str, axes: str) -> dict[str, np.ndarray]:
  """The same cases in this process, on the first devices of the 8-device host mesh."""
  sizes = [(name, int(size)) for name, size in (a.split("=") for a in axes.split(","))]
  n = int(np.prod([s for _, s in sizes]))
  mesh = distributed.mesh(sizes, devices=jax.devices()[:n])
  return {f"{c}/{k}": v for c in cases.split(",") for k, v in worker.CASES[c](mesh).items()}


def check_kernels(multi, single, what: str):
  for op, ours in (("logp", "all_gather"), ("matmul", "canonical")):
    # Every process computes the unsharded op identically; the run matches one process.
    assert_bitwise_equal(multi[f"kernels/{op}_unsharded"], single[f"kernels/{op}_unsharded"],
                         f"{op} unsharded, {what}")
    for merge in (ours, "psum"):
      assert_bitwise_equal(multi[f"kernels/{op}_{merge}"], single[f"kernels/{op}_{merge}"],
                           f"{op} {merge}: {what} vs 1 process")
    # Ours equals the unsharded op; the psum merge (the control) does not on these rows.
    assert_bitwise_equal(multi[f"kernels/{op}_{ours}"], single[f"kernels/{op}_unsharded"],
                         f"{op} TP=2 vs unsharded, {what}")
    psum, ref = multi[f"kernels/{op}_psum"], single[f"kernels/{op}_unsharded"]
    assert not np.array_equal(bits(psum), bits(ref)), f"{op}: the psum control matched"
    assert rel_err(psum, ref) < 1e-5, f"{op}: the psum control is not even close"


# Each tp pair spans both processes, so the TP collectives cross processes over gloo.
AXES = "tp=2,dp=2"


def _needs_cpu_backend():
  # The single-process side runs on this process's default devices, which must be the
  # workers' kind (CPU); the GPU launch has its own test below.
  if jax.default_backend() != "cpu":
    pytest.skip(f"the CPU workers are compared with this process's default devices, which "
                f"are {jax.default_backend()!r} here (the gpu test covers GPUs)")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  _needs_cpu_backend()
  return launch(CASES, num_processes=2, local_devices=2, axes=AXES,
                tmp_path=tmp_path_factory.mktemp("two_processes"))


@pytest.fixture(scope="module")
def one_process():
  _needs_cpu_backend()
  return single_process(CASES, AXES)


def test_kernels_across_two_processes_are_bitwise(two_processes, one_process):
  check_kernels(two_processes, one_process, "2 processes x 2 devices")


def test_sharded_model_across_two_processes_is_bitwise(two_processes, one_process):
  # A DecoderLM sharded TP=2 x DP=2 with each tp pair across processes: the same per-token
  # log-probs as one process with the same mesh, and as the unsharded model.
  multi, single = two_processes["model/logp"], one_process["model/logp"]
  assert_bitwise_equal(multi, single, "model log-probs: 2 processes vs 1")
  assert_bitwise_equal(two_processes["model/logp_unsharded"], one_process["model/logp_unsharded"],
                       "unsharded model")
  assert_bitwise_equal(multi, one_process["model/logp_unsharded"], "TP=2 x DP=2 vs unsharded")


def test_mixture_of_experts_across_two_processes_is_bitwise(two_processes, one_process):
  # Expert parallelism with the experts' all-to-all across processes (the MoE layer, EP = 2
  # over tp, output and gradients), and a qwen3_moe model sharded TP = 2 x DP = 2 (experts
  # over tp): bitwise one process with the same mesh, and the unsharded layer and model.
  for name in ("layer_y", "layer_dx", "layer_dgate_up", "layer_ddown", "model_logp"):
    multi, single = two_processes[f"moe/{name}"], one_process[f"moe/{name}"]
    assert_bitwise_equal(multi, single, f"{name}: 2 processes vs 1")
    assert_bitwise_equal(multi, one_process[f"moe/{name}_unsharded"], f"{name} vs unsharded")
    assert_bitwise_equal(two_processes[f"moe/{name}_unsharded"],
                         one_process[f"moe/{name}_unsharded"], f"{name} unsharded")


@pytest.mark.slow
@pytest.mark.parametrize("num_processes, local_devices, axes", [
    (4, 1, "tp=2,dp=2"),  # every device its own process
    (2, 2, "dp=2,tp=2"),  # tp inside a process, dp across
])
def test_kernels_other_process_layouts(num_processes, local_devices, axes, tmp_path):
  _needs_cpu_backend()
  multi = launch("kernels", num_processes=num_processes, local_devices=local_devices,
                 axes=axes, tmp_path=tmp_path)
  check_kernels(multi, single_process("kernels", axes), f"{num_processes} processes, {axes}")


@pytest.mark.gpu
def test_one_process_per_gpu_is_bitwise(tmp_path):
  # The launch of docs/distributed.md on a machine with 2 GPUs: tp across the processes.
  if jax.device_count() < 2:
    pytest.skip(f"needs 2 GPUs, this machine has {jax.device_count()}")
  multi = launch(CASES, num_processes=2, local_devices=None, axes="tp=2,dp=1",
                 tmp_path=tmp_path, gpu=True)
  single = single_process(CASES, "tp=2,dp=1")
  check_kernels(multi, single, "2 processes x 1 GPU")
  assert_bitwise_equal(multi["model/logp"], single["model/logp"], "model: 2 processes vs 1")
  assert_bitwise_equal(multi["model/logp"], single["model/logp_unsharded"], "model vs unsharded")


def test_a_process_whose_coordinator_never_comes_fails_loudly(tmp_path):
  port = distributed.free_port()
  r = subprocess.run(_worker_cmd(1, 2, port, local_devices=1, axes="tp=2", cases="kernels",
                                 out=tmp_path / "x.npz", join_timeout_s=2),
                     capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
  assert r.returncode == 1, r.stderr
  assert (f"RuntimeError: distributed.initialize: process 1 of 2 could not reach the "
          f"coordinator at 127.0.0.1:{port} (process 0) before the timeout") in r.stderr
  assert not (tmp_path / "x.npz").exists()


def test_a_coordinator_port_in_use_fails_loudly(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    r = subprocess.run(_worker_cmd(0, 2, port, local_devices=1, axes="tp=2", cases="kernels",
                                   out=tmp_path / "x.npz", join_timeout_s=2),
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
  assert r.returncode == 1, r.stderr
  assert (f"RuntimeError: distributed.initialize: process 0 serves the coordinator on port "
          f"{port}, which is already in use on this host") in r.stderr


# ------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator_address="localhost"), "coordinator_address must be 'host:port'"),
    (dict(coordinator_address="127.0.0.1:0"), "port in [1, 65535], got '127.0.0.1:0'"),
    (dict(num_processes=0), "num_processes must be an int >= 1, got 0"),
    (dict(process_id=2), "process_id must be an int in [0, 2), got 2"),
    (dict(process_id=-1), "process_id must be an int in [0, 2), got -1"),
    (dict(local_device_count=0), "local_device_count must be None or an int >= 1, got 0"),
    (dict(timeout_s=0), "timeout_s must be an int >= 1, got 0"),
])
def test_initialize_names_the_bad_argument(kwargs, message):
  args = dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=0) | kwargs
  with pytest.raises(ValueError, match="distributed.initialize: ") as e:
    distributed.initialize(**args)
  assert message in str(e.value)


def test_initialize_after_jax_started_says_so():
  jax.devices()  # this process's backends are running
  with pytest.raises(RuntimeError, match="JAX's backends already started in this process"):
    distributed.initialize("127.0.0.1:1234", 2, 0)


def test_mesh_order_and_errors():
  devs = jax.devices()[:4]
  m = distributed.mesh([("tp", 2), ("dp", 2)], devices=devs)
  assert m.axis_names == ("tp", "dp") and m.devices.tolist() == [devs[:2], devs[2:]]
  with pytest.raises(ValueError, match=r"axis sizes \{'tp': 2, 'dp': 4\} multiply to 8 but the "
                                       r"run has 4 devices"):
    distributed.mesh([("tp", 2), ("dp", 4)], devices=devs)
  with pytest.raises(ValueError, match="axis names must be distinct"):
    distributed.mesh([("tp", 2), ("tp", 2)], devices=devs)
  with pytest.raises(ValueError, match=r"axes must be \(name, size >= 1\) pairs"):
    distributed.mesh([("tp", 0)], devices=devs)
  with pytest.raises(ValueError, match=r"distributed.mesh: devices must be distinct, got .* "
                                       r"more than once"):
    distributed.mesh([("tp", 2), ("dp", 2)], devices=[devs[0], devs[1], devs[2], devs[0]])

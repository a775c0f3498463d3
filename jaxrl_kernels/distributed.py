"""Multi-process runs on JAX's distributed runtime: one process per GPU or host, one mesh.

Every process calls :func:`initialize` first (before anything touches a JAX device),
with the same ``coordinator_address`` and ``num_processes`` and its own ``process_id``
in ``0 .. num_processes - 1``. JAX then sees the devices of *all* processes
(``jax.devices()``, ``jax.device_count()``) and a ``Mesh`` over them spans processes:
``shard_map``/``jit`` programs run on every process at once (each process runs the same
program on its own devices), and collectives cross processes (NCCL on GPUs, gloo over
TCP on CPUs).

:func:`mesh` lays the global devices out in a fixed order (process-major, then local
device id), so that the same axis sizes give the same mesh, and hence the same
program and the same bits, on one process with ``N`` devices and on ``P`` processes
with ``N / P`` devices each. Nothing in the numerics depends on the process count:
every reduction order in this package is fixed by ``contract.py`` and by the mesh axis
sizes, never by where a device lives (docs/distributed.md).
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh


def _check_address(address) -> tuple[str, int]:
  if not isinstance(address, str) or address.count(":") < 1:
    raise ValueError(f"distributed.initialize: coordinator_address must be 'host:port', got "
                     f"{address!r}")
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"distributed.initialize: coordinator_address must be 'host:port' with a "
                     f"port in [1, 65535], got {address!r}")
  return host, int(port)


def _is_int(x) -> bool:
  return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_device_count: int | None = None, timeout_s: int = 300) -> None:
  """Joins this process to a ``num_processes``-process JAX run.

  Wraps ``jax.distributed.initialize``. On CPUs it also selects gloo (TCP) for the
  collectives between processes and, with ``local_device_count``, how many CPU
  devices this process owns, both of which must be set before JAX starts its CPU
  backend. On GPUs a process owns the GPUs it can see: run one process per GPU with
  ``CUDA_VISIBLE_DEVICES`` set to that GPU (docs/distributed.md).

  Args:
    coordinator_address: ``"host:port"`` of process 0, where it serves the coordinator;
      every process passes the same one (``"127.0.0.1:PORT"`` on one machine, see
      :func:`free_port`).
    num_processes: ``P >= 1``, the number of processes.
    process_id: this process's index in ``[0, P)``.
    local_device_count: CPU devices of this process (``jax_num_cpu_devices``; the global
      mesh has ``P * local_device_count`` devices). None: JAX's default (one, or
      ``--xla_force_host_platform_device_count``). It has no effect on GPU devices.
    timeout_s: seconds to wait for every process to join before failing.

  Raises:
    ValueError: an argument out of range (named, with the value).
    RuntimeError: JAX's backends already started in this process (too late to join a
      run); process 0's port is in use; another process cannot reach the coordinator
      within ``timeout_s``; or the runtime refused the run (its error, with the address).
      A process that joined but whose peers never do is aborted by JAX's runtime after
      ``timeout_s`` (a gRPC ``DEADLINE_EXCEEDED`` on stderr, exit status 134).
  """
  op = "distributed.initialize"
  host, port = _check_address(coordinator_address)
  if not _is_int(num_processes) or num_processes < 1:
    raise ValueError(f"{op}: num_processes must be an int >= 1, got {num_processes!r}")
  if not _is_int(process_id) or not 0 <= process_id < num_processes:
    raise ValueError(f"{op}: process_id must be an int in [0, {num_processes}), got "
                     f"{process_id!r}")
  if local_device_count is not None and (not _is_int(local_device_count)
                                         or local_device_count < 1):
    raise ValueError(f"{op}: local_device_count must be None or an int >= 1, got "
                     f"{local_device_count!r}")
  if not _is_int(timeout_s) or timeout_s < 1:
    raise ValueError(f"{op}: timeout_s must be an int >= 1, got {timeout_s!r}")
  from jax._src import xla_bridge
  # jax.distributed.initialize checks this too, with this same function; asking first
  # keeps the message ours and stops before the coordinator checks below.
  started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
  if started():
    raise RuntimeError(f"{op}: JAX's backends already started in this process (something "
                       f"touched a device: jax.devices(), an array, a jitted call); call "
                       f"initialize first, right after importing jax")
  deadline = time.monotonic() + timeout_s
  if process_id == 0:
    _check_bindable(port)
  else:
    _wait_for_coordinator(host, port, process_id, num_processes, deadline)
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  # Gloo is JAX's CPU default today; naming it keeps a run from silently losing its
  # cross-process collectives if that default changes. GPUs use NCCL regardless.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator_address=f"{host}:{port}",
                               num_processes=int(num_processes), process_id=int(process_id),
                               initialization_timeout=max(1, int(deadline - time.monotonic())))
  except Exception as e:  # the runtime raises bare XlaRuntimeError/RuntimeError
    raise RuntimeError(f"{op}: process {process_id} of {num_processes} could not join the run "
                       f"at {host}:{port} within {timeout_s}s: {e}") from e


def _check_bindable(port: int) -> None:
  """Process 0 serves the coordinator on ``port``: say so clearly when something holds it
  (JAX's runtime would abort the process with a gRPC message instead)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    # As the coordinator's own socket: a port left in TIME_WAIT by an earlier run is free.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        raise
      raise RuntimeError(f"distributed.initialize: process 0 serves the coordinator on port "
                         f"{port}, which is already in use on this host; pick another "
                         f"coordinator_address port (see free_port)") from e


def _wait_for_coordinator(host: str, port: int, process_id: int, num_processes: int,
                          deadline: float) -> None:
  """Waits until process 0's coordinator accepts TCP connections. Without it JAX's runtime
  aborts the whole process (SIGABRT, a gRPC deadline) when process 0 never comes up; this
  raises a Python error naming the address instead."""
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise RuntimeError(
            f"distributed.initialize: process {process_id} of {num_processes} could not reach "
            f"the coordinator at {host}:{port} (process 0) before the timeout: {e}; is process "
            f"0 running with the same coordinator_address?") from None
      time.sleep(0.2)


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` that nothing listens on now, for a coordinator address.

  The port is released before it is returned, so another program may take it first:
  a launcher retries with a new port when process 0 cannot bind (the test does).
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return int(s.getsockname()[1])


def mesh(axes: Sequence[tuple[str, int]], devices: Sequence | None = None) -> Mesh:
  """A ``Mesh`` over every device of the run (all processes), in a fixed order.

  Devices are sorted by (process index, id) and reshaped row-major to the axis sizes:
  the last axis varies fastest. With 2 processes of 2 devices each,
  ``mesh([("dp", 2), ("tp", 2)])`` puts each ``tp`` pair inside one process (the usual
  choice: tensor parallelism on the fast links of a host) and ``dp`` across processes;
  ``mesh([("tp", 2), ("dp", 2)])`` makes ``tp`` cross processes. On one process with 4
  devices both give the mesh of the same shape, so the same program.

  Args:
    axes: ``(name, size)`` pairs, outermost first; the sizes' product must equal the
      number of devices.
    devices: the devices to use (default ``jax.devices()``: every process's).

  Returns:
    ``Mesh(devices.reshape(sizes), names)``.
  """
  axes = tuple(axes)
  for a in axes:
    if (not isinstance(a, tuple) or len(a) != 2 or not isinstance(a[0], str)
        or not _is_int(a[1]) or a[1] < 1):
      raise ValueError(f"distributed.mesh: axes must be (name, size >= 1) pairs, got {axes!r}")
  names = [a[0] for a in axes]
  if len(set(names)) != len(names):
    raise ValueError(f"distributed.mesh: axis names must be distinct, got {names}")
  devs = sorted(jax.devices() if devices is None else devices,
                key=lambda d: (d.process_index, d.id))
  for a, b in zip(devs, devs[1:]):  # sorted: a device listed twice sits next to itself
    if (a.process_index, a.id) == (b.process_index, b.id):
      raise ValueError(f"distributed.mesh: devices must be distinct, got {b} more than once")
  sizes = tuple(int(a[1]) for a in axes)
  if int(np.prod(sizes)) != len(devs):
    raise ValueError(f"distributed.mesh: axis sizes {dict(axes)} multiply to "
                     f"{int(np.prod(sizes))} but the run has {len(devs)} devices "
                     f"({jax.process_count()} processes)")
  return Mesh(np.asarray(devs, dtype=object).reshape(sizes), tuple(names))

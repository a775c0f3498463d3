"""The main command end to end on this device."""

from jaxrl_kernels.__main__ import main


def test_main_reports_bitwise_invariance_and_exits_zero(capsys):
  assert main([]) == 0
  out = capsys.readouterr().out
  assert "det_matmul" in out and "jnp.dot (XLA)" in out
  assert "bitwise batch-invariant on this device" in out
  # The report shows the device, the jax version and the drift table.
  assert "jax " in out and "logprob drift" in out

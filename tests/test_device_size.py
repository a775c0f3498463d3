"""The persistent grid's size as a config knob (``num_ctas``): refused by name unless None
or a positive int, and the size the kernels launch with. Its bits: tests/test_device_size_gpu.py."""

import pytest

from jaxrl_kernels import _backend
from jaxrl_kernels.pallas import gemm_mosaic, mosaic_loop
from jaxrl_kernels.pallas import linear_logp_mosaic as lm


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "78"])
def test_bad_grid_sizes_are_refused_by_name(bad):
  for make in (lambda: gemm_mosaic.Config(num_ctas=bad), lambda: lm.Config(num_ctas=bad),
               lambda: mosaic_loop.LoopConfig(64, 128, 2, "m", 4, "n", 1, num_ctas=bad)):
    with pytest.raises(ValueError, match="num_ctas"):
      make()


def test_grid_size():
  assert mosaic_loop.grid_size(gemm_mosaic.Config(num_ctas=78).loop) == 78
  assert mosaic_loop.grid_size(lm.Config(num_ctas=1).loop) == 1
  assert mosaic_loop.grid_size(gemm_mosaic.Config().loop) == _backend.num_sms()

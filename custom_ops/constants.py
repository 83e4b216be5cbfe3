"""Constants the kernels and the Python side share, defined once here for Python; the C++
headers hold the same values and tests/test_kernel_constants.py reads them and checks."""

SPARSE_ATTENTION_BLOCK = 64  # the reference kernel's block of indices (sparse_attention.h kBlock)
# finite, so an all -1 row gives exp(sink + 1e30) = inf -> o = 0 (kRunningMaxInit)
SPARSE_ATTENTION_RUNNING_MAX_INIT = -1e30
FP8_BLOCK = 32  # act_quant and the fp8 linears' block (fp8_linear.h)
TORCH_LINEAR_PANEL = 64  # columns per panel of TorchLinear's packed W (torch_linear_op.cc kPanel)

"""Pure-PyTorch references, one module per op (``twinspark.reference.<op>``); they run on the CPU and the GPU."""

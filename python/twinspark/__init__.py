"""twinspark: EXL3 kernels and the tooling that serves DeepSeek V4.1 Flash with vLLM on two DGX Sparks.

Layout (one name per op everywhere): ``cuda/<op>/`` device code, ``twinspark.ops.<op>`` the torch op,
``twinspark.reference.<op>`` its pure-PyTorch reference, ``tests/test_<op>.py``, ``bench/bench_<op>.py``.
"""

__version__ = "0.1.0"

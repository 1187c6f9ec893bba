"""Kernels written in CUDA C, compiled when first used by NVRTC (the runtime compiler that CUDA builds of torch ship)
and launched through the driver API (runtime.py): where a kernel's structure needs what Triton does not express,
such as the 4-bit GEMV of fp4_gemv.cu."""

"""CUDA C sources compiled at run time and launched through the driver API.

NVRTC, the runtime compiler that CUDA builds of torch ship as a library (libnvrtc), compiles a source of this
package for the GPU in hand, instantiating one kernel template with the shape given as its arguments (a name
expression such as "fp4_gemv<2688, 2, 4, 1, 1>"); the cubin is loaded as a module
of the current context (torch's) and its kernel launched with cuLaunchKernelEx on torch's current stream, so that
launches join CUDA graphs being captured like any other. `pdl=True` sets the programmatic-stream-serialization
attribute: the kernel may start before the one before it ends, and must then wait for it in its code
(griddepcontrol.wait) as the Triton kernels do (kernels/triton/pdl.py has the rules).

Sources include no headers: the few float16 and bfloat16 operations they need are written in inline PTX, so
compiling needs NVRTC alone, not a CUDA toolkit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

import torch

from shardserve import envs
from shardserve.kernels import cuda_driver

logger = logging.getLogger(__name__)

_SOURCES = os.path.dirname(os.path.abspath(__file__))
# cuLaunchKernelEx's attribute for programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# Dynamic shared memory a block: what every kernel may take, and cuFuncSetAttribute's attribute for more
# (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
_DEFAULT_SHARED = 48 * 1024
_MAX_DYNAMIC_SHARED = 8


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def nvrtc() -> ctypes.CDLL | None:
    """libnvrtc of torch's CUDA major version (loaded with torch's CUDA libraries), or None where there is none."""
    if torch.version.cuda is None:
        return None
    major = torch.version.cuda.split(".")[0]
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CompileError(RuntimeError):
    """A kernel of this package that NVRTC could not compile here (or no NVRTC): the callers fall back to Triton."""


# Set by the first CompileError of the process (its message): none of this package's kernels is used after it.
_failed: str | None = None


def disable(error: CompileError) -> None:
    """Stop offering this package's kernels in this process, with one WARNING that says why."""
    global _failed
    if _failed is None:
        logger.warning("CUDA C kernels off for this process (the Triton kernels serve instead): %s", error)
        _failed = str(error)


def available(device: torch.device) -> bool:
    """Whether this package's kernels can run on `device`: SHARDSERVE_CUDA_KERNELS not off, a CUDA GPU of compute
    capability 9.0 or newer (they use Hopper's dependent-launch instructions), the driver API and NVRTC, and no
    kernel failed to compile in this process (disable)."""
    from shardserve.kernels.triton import pdl

    return (envs.CUDA_KERNELS.get() != "off" and _failed is None and pdl.supported(device)
            and cuda_driver.driver() is not None and nvrtc() is not None)


def _check_nvrtc(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(f"{what} failed: NVRTC error {result} ({lib.nvrtcGetErrorString(result).decode()})")


def compile_cubin(source: str, filename: str, arch: str, expression: str) -> tuple[bytes, str]:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90a") with the kernel template instance `expression`:
    (the cubin, the instance's name in it). A source that does not compile raises CompileError with NVRTC's log."""
    lib = nvrtc()
    if lib is None:
        raise CompileError("NVRTC is not available (a CUDA build of torch ships it)")
    program = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), filename.encode(), 0, None,
                                             None), "nvrtcCreateProgram")
    try:
        _check_nvrtc(lib, lib.nvrtcAddNameExpression(program, expression.encode()), "nvrtcAddNameExpression")
        options = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device"]
        array = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(program, len(options), array)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise CompileError(f"{expression} of {filename} did not compile:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        lowered = ctypes.c_char_p()
        _check_nvrtc(lib, lib.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(lowered)),
                     "nvrtcGetLoweredName")
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


class Kernel:
    """One compiled kernel of a loaded module; call `launch`."""

    def __init__(self, cubin: bytes, name: str) -> None:  # name: as the cubin has it (lowered)
        drv = cuda_driver.driver()
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))  # the module's image, kept alive
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
        cuda_driver.check(drv.cuModuleLoadData(ctypes.byref(self._module), self._cubin), "cuModuleLoadData")
        cuda_driver.check(drv.cuModuleGetFunction(ctypes.byref(self._function), self._module, name.encode()),
                          f"cuModuleGetFunction({name})")
        self.name = name
        self._shared_allowed = _DEFAULT_SHARED

    def _allow_shared(self, nbytes: int) -> None:
        """Above 48 KB of dynamic shared memory a kernel must opt in, once, before it launches with that much."""
        if nbytes > self._shared_allowed:
            cuda_driver.check(cuda_driver.driver().cuFuncSetAttribute(self._function, _MAX_DYNAMIC_SHARED, nbytes),
                              f"{self.name}: {nbytes} bytes of dynamic shared memory")
            self._shared_allowed = nbytes

    def blocks_per_sm(self, threads: int, shared_bytes: int = 0) -> int:
        """How many blocks of `threads` threads and `shared_bytes` of dynamic shared memory an SM holds at once (0:
        none fits), for kernels whose blocks must all be placed at once."""
        self._allow_shared(shared_bytes)
        fits = ctypes.c_int()
        cuda_driver.check(cuda_driver.driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(fits), self._function, threads, ctypes.c_size_t(shared_bytes)), f"{self.name}: occupancy")
        return fits.value

    def launch(self, grid: tuple[int, ...], block: int, args: list, pdl: bool = False, shared_bytes: int = 0) -> None:
        """Launch on torch's current stream with `shared_bytes` of dynamic shared memory a block. args: tensors (their
        data pointers), None (a null pointer), ints (32-bit) and floats (32-bit)."""
        values = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            elif arg is None:
                values.append(ctypes.c_void_p(0))
            elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
                raise TypeError(f"{self.name}: an argument of type {type(arg).__name__}")
            else:
                values.append(ctypes.c_int(arg) if isinstance(arg, int) else ctypes.c_float(arg))
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
        grid = (*grid, 1, 1)[:3]
        attrs = (_Attribute * 1)()
        attrs[0].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[0].value.value = 1
        self._allow_shared(shared_bytes)
        config = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, shared_bytes,
                               ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), attrs, 1 if pdl else 0)
        cuda_driver.check(cuda_driver.driver().cuLaunchKernelEx(ctypes.byref(config), self._function, pointers, None),
                          f"launching {self.name}")


_lock = threading.Lock()


@functools.cache
def _source(filename: str) -> str:
    with open(os.path.join(_SOURCES, filename)) as f:
        return f.read()


@functools.cache
def _kernel(filename: str, expression: str, device_index: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}a" if major == 9 else f"sm_{major}{minor}"
    cubin, name = compile_cubin(_source(filename), filename, arch, expression)
    with torch.cuda.device(device_index):
        torch.cuda.init()
        return Kernel(cubin, name)


def kernel(filename: str, template: str, arguments: tuple[int, ...], device: torch.device) -> Kernel:
    """The kernel template `template` of this package's source `filename` instantiated with `arguments` for
    `device`'s GPU, compiled and loaded once per (source, instance, device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        return _kernel(filename, f"{template}<{', '.join(str(int(a)) for a in arguments)}>", index)

"""cffi API-mode builder for ``vkxsplit._native`` (the C code in native/vkx_native.c).

Used by setup.py as ``cffi_modules=["native/build_native.py:ffibuilder"]``, so
``pip install -e .`` (or any wheel build) compiles the extension with the system C compiler.
Run directly (``python native/build_native.py``) to build ``vkxsplit/_native.abi3.so`` in place
without pip.
"""

from __future__ import annotations

import os

import cffi

_HERE = os.path.dirname(os.path.abspath(__file__))


def _rel(path: str) -> str:
    """A path relative to the current directory when possible (setuptools prefers those)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (not on Linux, kept for safety)
        return path
    return path if rel.startswith("..") else rel


CDEF = """
#define VKX_MAX_FDS 253
#define VKX_UAPI_SYS_DMA_HEAP 1
#define VKX_UAPI_SYS_UDMABUF 2
#define VKX_UAPI_SYS_DMA_BUF_SYNC 4
#define VKX_UAPI_SYS_EXPORT_SYNC_FILE 8
#define VKX_UAPI_SYS_IMPORT_SYNC_FILE 16

int vkx_dma_heap_alloc(const char *heap_name, uint64_t size, int *out_fd);
int vkx_udmabuf_create(int memfd, uint64_t offset, uint64_t size, int *out_fd);
int vkx_memfd_create(const char *name, uint64_t size, int *out_fd);
int vkx_dmabuf_sync(int fd, int begin, int read, int write);
int vkx_dmabuf_export_sync_file(int dmabuf_fd, uint32_t flags, int *out_fd);
int vkx_dmabuf_import_sync_file(int dmabuf_fd, uint32_t flags, int sync_fd);
int vkx_sync_file_wait(int fd, int timeout_ms);
int vkx_send_fds(int sock, const int *fds, int n, const void *data, size_t len);
int vkx_recv_fds(int sock, int *fds, int max, int *n_out, void *data, size_t cap, size_t *len_out);
int vkx_close(int fd);
const char *vkx_last_op(void);

size_t vkx_uapi_count(void);
const char *vkx_uapi_name(size_t index);
uint64_t vkx_uapi_value(size_t index);
int vkx_uapi_lookup(const char *name, uint64_t *out);
int vkx_uapi_system_headers(void);
"""


ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "vkxsplit._native",
    '#include "vkx_native.h"\n',
    sources=[_rel(os.path.join(_HERE, "vkx_native.c"))],
    include_dirs=[_rel(_HERE)],
    depends=[_rel(os.path.join(_HERE, "vkx_native.h"))],
    extra_compile_args=["-O2", "-Wall"],
)


def build_in_place() -> None:
    """``setup.py build_ext --inplace`` with its scratch files under native/_build/.

    Goes through setuptools (as pip does) so the module gets the same name, vkxsplit/_native.abi3.so,
    and a later ``pip install -e .`` replaces it instead of leaving a stale copy that wins the import.
    """
    import subprocess
    import sys

    root = os.path.dirname(_HERE)
    scratch = os.path.join("native", "_build")  # relative to root, where setup.py runs
    cmd = [
        sys.executable,
        "setup.py",
        "build_ext",
        "--inplace",
        "--build-temp",
        scratch,
        "--build-lib",
        scratch,
    ]
    if subprocess.run(cmd, cwd=root).returncode == 0:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("setuptools")
    except PackageNotFoundError:
        have = "none"
    if have == "none" or int(have.split(".")[0]) < 77:
        # pyproject.toml's license string (PEP 639) needs setuptools 77; older ones refuse the file
        sys.exit(f"build_native: setuptools {have} in {sys.executable} is too old for pyproject.toml "
                 "(needs >= 77): pip install 'setuptools>=77', or build with pip install -e .")
    sys.exit("build_native: setup.py build_ext failed (see above)")

if __name__ == "__main__":
    build_in_place()

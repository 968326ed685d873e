"""cffi API-mode builder for ``vkxsplit._native`` (the C code in native/vkx_native.c).

Used by setup.py as ``cffi_modules=["native/build_native.py:ffibuilder"]``, so
``pip install -e .`` (or any wheel build) compiles the extension with the system C compiler.
Run directly (``python native/build_native.py``) to build ``vkxsplit/_native*.so`` in place
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


def make_builder(absolute_paths: bool = False) -> cffi.FFI:
    """The FFI builder; setuptools gets relative source paths, a direct build absolute ones."""
    fix = (lambda p: p) if absolute_paths else _rel
    builder = cffi.FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "vkxsplit._native",
        '#include "vkx_native.h"\n',
        sources=[fix(os.path.join(_HERE, "vkx_native.c"))],
        include_dirs=[fix(_HERE)],
        depends=[fix(os.path.join(_HERE, "vkx_native.h"))],
        extra_compile_args=["-O2", "-Wall"],
    )
    return builder


ffibuilder = make_builder()


def build_in_place() -> str:
    """Compile into native/_build/ and copy the module next to the package: vkxsplit/_native*.so."""
    import glob
    import shutil

    tmpdir = os.path.join(_HERE, "_build")
    so_path = make_builder(absolute_paths=True).compile(tmpdir=tmpdir, verbose=True)
    pkg = os.path.join(os.path.dirname(_HERE), "vkxsplit")
    for stale in glob.glob(os.path.join(pkg, "_native*.so")):  # e.g. an _native.abi3.so from pip
        os.remove(stale)
    dest = os.path.join(pkg, os.path.basename(so_path))
    shutil.copyfile(so_path, dest)
    return dest


if __name__ == "__main__":
    print(build_in_place())

/*
 * vkx_native.h - dma-buf, dma-heap, udmabuf, sync_file and fd-passing helpers for vkxsplit.
 *
 * Every function returns 0 (or a documented non-negative value) on success and a negative errno
 * on failure; none of them aborts, raises a signal or leaks a file descriptor on an error path.
 * Every descriptor handed back through an out parameter is O_CLOEXEC and owned by the caller.
 * vkx_last_op() names the system call or ioctl that produced the last error on this thread.
 *
 * Kernel uapi followed: <linux/dma-heap.h>, <linux/udmabuf.h>, <linux/dma-buf.h>, memfd_create(2),
 * fcntl(2) file seals, poll(2) on a sync_file, unix(7) SCM_RIGHTS.
 */
#ifndef VKX_NATIVE_H
#define VKX_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most descriptors one SCM_RIGHTS message can carry (the kernel's SCM_MAX_FD). */
#define VKX_MAX_FDS 253

/* Allocate `size` bytes from /dev/dma_heap/<heap_name> (DMA_HEAP_IOCTL_ALLOC); *out_fd gets the dma-buf. */
int vkx_dma_heap_alloc(const char *heap_name, uint64_t size, int *out_fd);

/* Wrap [offset, offset+size) of a shmem memfd sealed with F_SEAL_SHRINK as a dma-buf (UDMABUF_CREATE). */
int vkx_udmabuf_create(int memfd, uint64_t offset, uint64_t size, int *out_fd);

/* memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING), ftruncate(size), then F_ADD_SEALS(F_SEAL_SHRINK). */
int vkx_memfd_create(const char *name, uint64_t size, int *out_fd);

/* DMA_BUF_IOCTL_SYNC: begin!=0 -> DMA_BUF_SYNC_START, else DMA_BUF_SYNC_END; read/write pick the access. */
int vkx_dmabuf_sync(int fd, int begin, int read, int write);

/* DMA_BUF_IOCTL_EXPORT_SYNC_FILE: flags is DMA_BUF_SYNC_READ and/or DMA_BUF_SYNC_WRITE. */
int vkx_dmabuf_export_sync_file(int dmabuf_fd, uint32_t flags, int *out_fd);

/* DMA_BUF_IOCTL_IMPORT_SYNC_FILE: attach sync_fd to the dma-buf as a read or write fence. */
int vkx_dmabuf_import_sync_file(int dmabuf_fd, uint32_t flags, int sync_fd);

/* poll(POLLIN) with EINTR handled: 1 signalled (or hung up), 0 timed out, negative errno on error.
 * timeout_ms < 0 waits forever. */
int vkx_sync_file_wait(int fd, int timeout_ms);

/* Send `len` bytes with `n` descriptors attached (SCM_RIGHTS, MSG_NOSIGNAL: a closed peer gives
 * -EPIPE, never SIGPIPE). With n > 0, len must be >= 1: a stream socket drops ancillary data sent
 * with no payload. Returns once the whole payload is queued, waiting for room (poll POLLOUT) even
 * on a non-blocking socket, so a message is never cut or its descriptors sent twice. */
int vkx_send_fds(int sock, const int *fds, int n, const void *data, size_t len);

/* One recvmsg(MSG_CMSG_CLOEXEC): up to `max` descriptors into fds (*n_out) and up to `cap` bytes
 * into data (*len_out). *len_out == 0 with *n_out == 0 on a stream socket means end of stream.
 * A non-blocking socket with nothing queued gives -EAGAIN (nothing consumed).
 * If the sender attached more descriptors than `max` (MSG_CTRUNC), every descriptor received is
 * closed and -EMSGSIZE is returned. */
int vkx_recv_fds(int sock, int *fds, int max, int *n_out, void *data, size_t cap, size_t *len_out);

/* close(2); the descriptor is released even when this reports an error. */
int vkx_close(int fd);

/* The call ("ioctl(DMA_BUF_IOCTL_SYNC)", "open(/dev/udmabuf)", ...) that last failed on this thread. */
const char *vkx_last_op(void);

/* Introspection of the uapi values compiled in: ioctl numbers, flags, and sizeof/offsetof of the
 * structs passed to the kernel. Names look like "DMA_HEAP_IOCTL_ALLOC",
 * "sizeof(struct dma_heap_allocation_data)", "offsetof(struct dma_heap_allocation_data, fd)". */
size_t vkx_uapi_count(void);
const char *vkx_uapi_name(size_t index);
uint64_t vkx_uapi_value(size_t index);
/* 0 and *out set when the name is known, -ENOENT otherwise. */
int vkx_uapi_lookup(const char *name, uint64_t *out);
/* Which uapi definitions came from the system headers rather than vkx_native.c's own copy:
 * a bitmask of the VKX_UAPI_SYS_* bits below. */
#define VKX_UAPI_SYS_DMA_HEAP 1          /* <linux/dma-heap.h>: DMA_HEAP_IOCTL_ALLOC */
#define VKX_UAPI_SYS_UDMABUF 2           /* <linux/udmabuf.h>: UDMABUF_CREATE */
#define VKX_UAPI_SYS_DMA_BUF_SYNC 4      /* <linux/dma-buf.h>: DMA_BUF_IOCTL_SYNC */
#define VKX_UAPI_SYS_EXPORT_SYNC_FILE 8  /* <linux/dma-buf.h>: DMA_BUF_IOCTL_EXPORT_SYNC_FILE (Linux 6.0) */
#define VKX_UAPI_SYS_IMPORT_SYNC_FILE 16 /* <linux/dma-buf.h>: DMA_BUF_IOCTL_IMPORT_SYNC_FILE (Linux 6.0) */
int vkx_uapi_system_headers(void);

#ifdef __cplusplus
}
#endif

#endif /* VKX_NATIVE_H */

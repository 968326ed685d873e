/*
 * vkx_native.c - see vkx_native.h. C99 plus the Linux/glibc interfaces named below; gcc.
 *
 * Build with -DVKX_NO_SYSTEM_UAPI_HEADERS to ignore <linux/dma-heap.h>, <linux/udmabuf.h> and
 * <linux/dma-buf.h> and use the copies below (tests compile it that way to check the copies
 * against the headers).
 */
#define _GNU_SOURCE 1

#include "vkx_native.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <linux/ioctl.h>
#include <linux/types.h>

#if !defined(VKX_NO_SYSTEM_UAPI_HEADERS) && defined(__has_include)
#if __has_include(<linux/dma-heap.h>)
#include <linux/dma-heap.h>
#endif
#if __has_include(<linux/udmabuf.h>)
#include <linux/udmabuf.h>
#endif
#if __has_include(<linux/dma-buf.h>)
#include <linux/dma-buf.h>
#endif
#elif !defined(VKX_NO_SYSTEM_UAPI_HEADERS)
#include <linux/dma-buf.h>
#endif

/* ---- uapi copies, used only where the system headers lack them (kernel uapi, verbatim layout) ---- */

static const int vkx_sys_headers = 0
#ifdef DMA_HEAP_IOCTL_ALLOC
    | VKX_UAPI_SYS_DMA_HEAP
#endif
#ifdef UDMABUF_CREATE
    | VKX_UAPI_SYS_UDMABUF
#endif
#ifdef DMA_BUF_IOCTL_SYNC
    | VKX_UAPI_SYS_DMA_BUF_SYNC
#endif
#ifdef DMA_BUF_IOCTL_EXPORT_SYNC_FILE
    | VKX_UAPI_SYS_EXPORT_SYNC_FILE
#endif
#ifdef DMA_BUF_IOCTL_IMPORT_SYNC_FILE
    | VKX_UAPI_SYS_IMPORT_SYNC_FILE
#endif
    ;

/* include/uapi/linux/dma-heap.h (Linux 5.6) */
#ifndef DMA_HEAP_IOCTL_ALLOC
struct dma_heap_allocation_data {
    __u64 len;
    __u32 fd;
    __u32 fd_flags;
    __u64 heap_flags;
};
#define DMA_HEAP_IOC_MAGIC 'H'
#define DMA_HEAP_IOCTL_ALLOC _IOWR(DMA_HEAP_IOC_MAGIC, 0x0, struct dma_heap_allocation_data)
#endif

/* include/uapi/linux/udmabuf.h (Linux 4.20) */
#ifndef UDMABUF_CREATE
#ifndef UDMABUF_FLAGS_CLOEXEC
#define UDMABUF_FLAGS_CLOEXEC 0x01
#endif
struct udmabuf_create {
    __u32 memfd;
    __u32 flags;
    __u64 offset;
    __u64 size;
};
#define UDMABUF_CREATE _IOW('u', 0x42, struct udmabuf_create)
#endif

/* include/uapi/linux/dma-buf.h (DMA_BUF_IOCTL_SYNC: Linux 4.6) */
#ifndef DMA_BUF_BASE
#define DMA_BUF_BASE 'b'
#endif
#ifndef DMA_BUF_IOCTL_SYNC
struct dma_buf_sync {
    __u64 flags;
};
#define DMA_BUF_IOCTL_SYNC _IOW(DMA_BUF_BASE, 0, struct dma_buf_sync)
#endif
#ifndef DMA_BUF_SYNC_READ
#define DMA_BUF_SYNC_READ (1 << 0)
#endif
#ifndef DMA_BUF_SYNC_WRITE
#define DMA_BUF_SYNC_WRITE (2 << 0)
#endif
#ifndef DMA_BUF_SYNC_RW
#define DMA_BUF_SYNC_RW (DMA_BUF_SYNC_READ | DMA_BUF_SYNC_WRITE)
#endif
#ifndef DMA_BUF_SYNC_START
#define DMA_BUF_SYNC_START (0 << 2)
#endif
#ifndef DMA_BUF_SYNC_END
#define DMA_BUF_SYNC_END (1 << 2)
#endif

/* include/uapi/linux/dma-buf.h (EXPORT/IMPORT_SYNC_FILE: Linux 6.0) */
#ifndef DMA_BUF_IOCTL_EXPORT_SYNC_FILE
struct dma_buf_export_sync_file {
    __u32 flags;
    __s32 fd;
};
#define DMA_BUF_IOCTL_EXPORT_SYNC_FILE _IOWR(DMA_BUF_BASE, 2, struct dma_buf_export_sync_file)
#endif
#ifndef DMA_BUF_IOCTL_IMPORT_SYNC_FILE
struct dma_buf_import_sync_file {
    __u32 flags;
    __s32 fd;
};
#define DMA_BUF_IOCTL_IMPORT_SYNC_FILE _IOW(DMA_BUF_BASE, 3, struct dma_buf_import_sync_file)
#endif

/* memfd_create(2) / fcntl(2) seals (include/uapi/linux/memfd.h, fcntl.h; Linux 3.17) */
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_LINUX_SPECIFIC_BASE
#define F_LINUX_SPECIFIC_BASE 1024
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS (F_LINUX_SPECIFIC_BASE + 9)
#endif
#ifndef F_GET_SEALS
#define F_GET_SEALS (F_LINUX_SPECIFIC_BASE + 10)
#endif
#ifndef F_SEAL_SHRINK
#define F_SEAL_SHRINK 0x0002
#endif
#ifndef MSG_CMSG_CLOEXEC
#define MSG_CMSG_CLOEXEC 0x40000000
#endif

/* ---- helpers ---- */

static __thread const char *vkx_op = "";

const char *vkx_last_op(void) { return vkx_op; }

/* Record the failing call and return -errno (never 0: a failure without errno becomes -EIO). */
static int fail(const char *op)
{
    int e = errno;
    vkx_op = op;
    return e > 0 ? -e : -EIO;
}

static int fail_with(const char *op, int err)
{
    vkx_op = op;
    return -err;
}

static int xioctl(int fd, unsigned long request, void *arg, int retry_eagain)
{
    int r;
    do {
        r = ioctl(fd, request, arg);
    } while (r == -1 && (errno == EINTR || (retry_eagain && errno == EAGAIN)));
    return r;
}

static void close_keep_errno(int fd)
{
    int e = errno;
    if (fd >= 0)
        (void)close(fd);
    errno = e;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0;
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- dma-heap ---- */

int vkx_dma_heap_alloc(const char *heap_name, uint64_t size, int *out_fd)
{
    char path[256];
    struct dma_heap_allocation_data data;
    int heap_fd, n;

    if (out_fd == NULL)
        return fail_with("argument check", EINVAL);
    *out_fd = -1;
    if (heap_name == NULL || heap_name[0] == '\0' || strchr(heap_name, '/') != NULL ||
        strcmp(heap_name, ".") == 0 || strcmp(heap_name, "..") == 0)
        return fail_with("argument check (heap name)", EINVAL);
    if (size == 0)
        return fail_with("argument check (size 0)", EINVAL);
    n = snprintf(path, sizeof path, "/dev/dma_heap/%s", heap_name);
    if (n < 0 || (size_t)n >= sizeof path)
        return fail_with("argument check (heap name)", ENAMETOOLONG);

    do {
        heap_fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (heap_fd < 0 && errno == EINTR);
    if (heap_fd < 0)
        return fail("open(/dev/dma_heap/<heap>)");

    memset(&data, 0, sizeof data); /* the kernel rejects a non-zero fd or heap_flags on input */
    data.len = size;
    data.fd_flags = O_RDWR | O_CLOEXEC;
    data.heap_flags = 0;
    if (xioctl(heap_fd, DMA_HEAP_IOCTL_ALLOC, &data, 0) != 0) {
        int r = fail("ioctl(DMA_HEAP_IOCTL_ALLOC)");
        close_keep_errno(heap_fd);
        return r;
    }
    (void)close(heap_fd);
    *out_fd = (int)data.fd;
    return 0;
}

/* ---- udmabuf ---- */

int vkx_udmabuf_create(int memfd, uint64_t offset, uint64_t size, int *out_fd)
{
    struct udmabuf_create create;
    int dev_fd, r;

    if (out_fd == NULL)
        return fail_with("argument check", EINVAL);
    *out_fd = -1;
    if (memfd < 0)
        return fail_with("argument check (memfd)", EBADF);
    if (size == 0)
        return fail_with("argument check (size 0)", EINVAL);

    do {
        dev_fd = open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
    } while (dev_fd < 0 && errno == EINTR);
    if (dev_fd < 0)
        return fail("open(/dev/udmabuf)");

    memset(&create, 0, sizeof create);
    create.memfd = (__u32)memfd;
    create.flags = UDMABUF_FLAGS_CLOEXEC;
    create.offset = offset;
    create.size = size;
    /* UDMABUF_CREATE returns the new dma-buf descriptor as the ioctl's result. */
    r = xioctl(dev_fd, UDMABUF_CREATE, &create, 0);
    if (r < 0) {
        int e = fail("ioctl(UDMABUF_CREATE)");
        close_keep_errno(dev_fd);
        return e;
    }
    (void)close(dev_fd);
    *out_fd = r;
    return 0;
}

/* ---- memfd ---- */

int vkx_memfd_create(const char *name, uint64_t size, int *out_fd)
{
    int fd;

    if (out_fd == NULL)
        return fail_with("argument check", EINVAL);
    *out_fd = -1;
    if (size > (uint64_t)INT64_MAX)
        return fail_with("argument check (size)", EFBIG);
    if (name == NULL)
        name = "vkx";

#ifdef SYS_memfd_create
    fd = (int)syscall(SYS_memfd_create, name, (unsigned int)(MFD_CLOEXEC | MFD_ALLOW_SEALING));
#else
    fd = -1;
    errno = ENOSYS;
#endif
    if (fd < 0)
        return fail("memfd_create");
    if (ftruncate(fd, (off_t)size) != 0) {
        int r = fail("ftruncate");
        close_keep_errno(fd);
        return r;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
        int r = fail("fcntl(F_ADD_SEALS, F_SEAL_SHRINK)");
        close_keep_errno(fd);
        return r;
    }
    *out_fd = fd;
    return 0;
}

/* ---- dma-buf ---- */

int vkx_dmabuf_sync(int fd, int begin, int read, int write)
{
    struct dma_buf_sync sync;

    if (fd < 0)
        return fail_with("argument check (fd)", EBADF);
    if (!read && !write)
        return fail_with("argument check (neither read nor write)", EINVAL);
    memset(&sync, 0, sizeof sync);
    sync.flags = (begin ? DMA_BUF_SYNC_START : DMA_BUF_SYNC_END) | (read ? DMA_BUF_SYNC_READ : 0) |
                 (write ? DMA_BUF_SYNC_WRITE : 0);
    /* Documented in dma-buf.h / dma-buf.rst: restart on EAGAIN or EINTR. */
    if (xioctl(fd, DMA_BUF_IOCTL_SYNC, &sync, 1) != 0)
        return fail("ioctl(DMA_BUF_IOCTL_SYNC)");
    return 0;
}

static int valid_sync_file_flags(uint32_t flags)
{
    return (flags & ~(uint32_t)DMA_BUF_SYNC_RW) == 0 && (flags & DMA_BUF_SYNC_RW) != 0;
}

int vkx_dmabuf_export_sync_file(int dmabuf_fd, uint32_t flags, int *out_fd)
{
    struct dma_buf_export_sync_file arg;

    if (out_fd == NULL)
        return fail_with("argument check", EINVAL);
    *out_fd = -1;
    if (dmabuf_fd < 0)
        return fail_with("argument check (dmabuf fd)", EBADF);
    if (!valid_sync_file_flags(flags))
        return fail_with("argument check (flags)", EINVAL);
    memset(&arg, 0, sizeof arg);
    arg.flags = flags;
    arg.fd = -1;
    if (xioctl(dmabuf_fd, DMA_BUF_IOCTL_EXPORT_SYNC_FILE, &arg, 0) != 0)
        return fail("ioctl(DMA_BUF_IOCTL_EXPORT_SYNC_FILE)");
    *out_fd = arg.fd;
    return 0;
}

int vkx_dmabuf_import_sync_file(int dmabuf_fd, uint32_t flags, int sync_fd)
{
    struct dma_buf_import_sync_file arg;

    if (dmabuf_fd < 0 || sync_fd < 0)
        return fail_with("argument check (fd)", EBADF);
    if (!valid_sync_file_flags(flags))
        return fail_with("argument check (flags)", EINVAL);
    memset(&arg, 0, sizeof arg);
    arg.flags = flags;
    arg.fd = sync_fd;
    if (xioctl(dmabuf_fd, DMA_BUF_IOCTL_IMPORT_SYNC_FILE, &arg, 0) != 0)
        return fail("ioctl(DMA_BUF_IOCTL_IMPORT_SYNC_FILE)");
    return 0;
}

/* ---- sync_file wait ---- */

int vkx_sync_file_wait(int fd, int timeout_ms)
{
    struct pollfd p;
    int64_t deadline = 0;
    int remaining = timeout_ms < 0 ? -1 : timeout_ms;

    if (fd < 0)
        return fail_with("argument check (fd)", EBADF);
    if (timeout_ms > 0)
        deadline = now_ms() + timeout_ms;
    for (;;) {
        int r;
        p.fd = fd;
        p.events = POLLIN;
        p.revents = 0;
        r = poll(&p, 1, remaining);
        if (r > 0) {
            if (p.revents & POLLNVAL)
                return fail_with("poll (POLLNVAL)", EBADF);
            /* A sync_file reports POLLIN once its fence has signalled (also with an error). */
            if (p.revents & (POLLIN | POLLHUP))
                return 1;
            return fail_with("poll (POLLERR)", EIO);
        }
        if (r == 0)
            return 0;
        if (errno != EINTR)
            return fail("poll");
        if (timeout_ms > 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return 0;
            remaining = (int)left;
        }
    }
}

/* ---- SCM_RIGHTS ---- */

typedef union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * VKX_MAX_FDS)];
} vkx_cmsg_buf;

/* Block until a (non-blocking) socket has room: 0, or -1 with errno set. */
static int wait_writable(int sock)
{
    struct pollfd p;
    int r;
    p.fd = sock;
    p.events = POLLOUT;
    p.revents = 0;
    do {
        r = poll(&p, 1, -1);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return -1;
    if (p.revents & POLLNVAL) {
        errno = EBADF;
        return -1;
    }
    return 0; /* POLLOUT, or POLLERR/POLLHUP: the next send reports the error */
}

int vkx_send_fds(int sock, const int *fds, int n, const void *data, size_t len)
{
    vkx_cmsg_buf ctl;
    struct msghdr msg;
    struct iovec iov;
    ssize_t r;
    size_t sent;
    int i;

    if (n < 0 || n > VKX_MAX_FDS || (n > 0 && fds == NULL) || (len > 0 && data == NULL))
        return fail_with("argument check", EINVAL);
    if (n > 0 && len == 0)
        return fail_with("argument check (descriptors need at least one payload byte)", EINVAL);
    for (i = 0; i < n; i++)
        if (fds[i] < 0)
            return fail_with("argument check (fd)", EBADF);

    memset(&msg, 0, sizeof msg);
    memset(&ctl, 0, sizeof ctl);
    iov.iov_base = (void *)data;
    iov.iov_len = len;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (n > 0) {
        struct cmsghdr *cmsg;
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
        cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
        memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * (size_t)n);
    }
    for (;;) {
        r = sendmsg(sock, &msg, MSG_NOSIGNAL);
        if (r >= 0)
            break;
        if (errno == EINTR)
            continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_writable(sock) == 0)
            continue;
        return fail("sendmsg");
    }
    /* A stream socket may take part of the payload; the descriptors went with the first byte,
     * so the rest must follow even on a non-blocking socket (wait for room, never resend). */
    sent = (size_t)r;
    while (sent < len) {
        r = send(sock, (const char *)data + sent, len - sent, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_writable(sock) == 0)
                continue;
            return fail("send");
        }
        sent += (size_t)r;
    }
    return 0;
}

int vkx_recv_fds(int sock, int *fds, int max, int *n_out, void *data, size_t cap, size_t *len_out)
{
    vkx_cmsg_buf ctl;
    struct msghdr msg;
    struct iovec iov;
    struct cmsghdr *cmsg;
    ssize_t r;
    int got = 0, overflow = 0, i;

    if (n_out != NULL)
        *n_out = 0;
    if (len_out != NULL)
        *len_out = 0;
    if (n_out == NULL || len_out == NULL || max < 0 || (max > 0 && fds == NULL) ||
        (cap > 0 && data == NULL))
        return fail_with("argument check", EINVAL);
    if (max > VKX_MAX_FDS)
        max = VKX_MAX_FDS;

    memset(&msg, 0, sizeof msg);
    memset(&ctl, 0, sizeof ctl);
    iov.iov_base = data;
    iov.iov_len = cap;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (max > 0) {
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)max);
    }
    do {
        r = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return fail("recvmsg");

    for (cmsg = CMSG_FIRSTHDR(&msg); cmsg != NULL; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
        size_t count, k;
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS)
            continue;
        count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (k = 0; k < count; k++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cmsg) + k * sizeof(int), sizeof fd);
            if (got < max)
                fds[got++] = fd;
            else {
                (void)close(fd);
                overflow = 1;
            }
        }
    }
    *len_out = (size_t)r;
    if (overflow || (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC))) {
        for (i = 0; i < got; i++)
            (void)close(fds[i]);
        return fail_with("recvmsg (descriptors or datagram truncated)", EMSGSIZE);
    }
    *n_out = got;
    return 0;
}

int vkx_close(int fd)
{
    if (fd < 0)
        return fail_with("close", EBADF);
    if (close(fd) != 0) {
        /* Linux releases the descriptor even when close() reports EINTR: do not retry. */
        if (errno == EINTR)
            return 0;
        return fail("close");
    }
    return 0;
}

/* ---- introspection ---- */

typedef struct {
    const char *name;
    uint64_t value;
} vkx_uapi_entry;

#define VKX_SIZEOF(s) {"sizeof(struct " #s ")", (uint64_t)sizeof(struct s)}
#define VKX_OFFSETOF(s, f) {"offsetof(struct " #s ", " #f ")", (uint64_t)offsetof(struct s, f)}
#define VKX_VALUE(v) {#v, (uint64_t)(v)}

static const vkx_uapi_entry vkx_uapi[] = {
    VKX_VALUE(DMA_HEAP_IOCTL_ALLOC),
    VKX_SIZEOF(dma_heap_allocation_data),
    VKX_OFFSETOF(dma_heap_allocation_data, len),
    VKX_OFFSETOF(dma_heap_allocation_data, fd),
    VKX_OFFSETOF(dma_heap_allocation_data, fd_flags),
    VKX_OFFSETOF(dma_heap_allocation_data, heap_flags),

    VKX_VALUE(UDMABUF_CREATE),
    VKX_VALUE(UDMABUF_FLAGS_CLOEXEC),
    VKX_SIZEOF(udmabuf_create),
    VKX_OFFSETOF(udmabuf_create, memfd),
    VKX_OFFSETOF(udmabuf_create, flags),
    VKX_OFFSETOF(udmabuf_create, offset),
    VKX_OFFSETOF(udmabuf_create, size),

    VKX_VALUE(DMA_BUF_IOCTL_SYNC),
    VKX_SIZEOF(dma_buf_sync),
    VKX_OFFSETOF(dma_buf_sync, flags),
    VKX_VALUE(DMA_BUF_SYNC_READ),
    VKX_VALUE(DMA_BUF_SYNC_WRITE),
    VKX_VALUE(DMA_BUF_SYNC_RW),
    VKX_VALUE(DMA_BUF_SYNC_START),
    VKX_VALUE(DMA_BUF_SYNC_END),

    VKX_VALUE(DMA_BUF_IOCTL_EXPORT_SYNC_FILE),
    VKX_SIZEOF(dma_buf_export_sync_file),
    VKX_OFFSETOF(dma_buf_export_sync_file, flags),
    VKX_OFFSETOF(dma_buf_export_sync_file, fd),

    VKX_VALUE(DMA_BUF_IOCTL_IMPORT_SYNC_FILE),
    VKX_SIZEOF(dma_buf_import_sync_file),
    VKX_OFFSETOF(dma_buf_import_sync_file, flags),
    VKX_OFFSETOF(dma_buf_import_sync_file, fd),

    VKX_VALUE(MFD_CLOEXEC),
    VKX_VALUE(MFD_ALLOW_SEALING),
    VKX_VALUE(F_ADD_SEALS),
    VKX_VALUE(F_GET_SEALS),
    VKX_VALUE(F_SEAL_SHRINK),
    VKX_VALUE(SCM_RIGHTS),
    VKX_VALUE(MSG_CMSG_CLOEXEC),
    VKX_VALUE(VKX_MAX_FDS),
};

size_t vkx_uapi_count(void) { return sizeof vkx_uapi / sizeof vkx_uapi[0]; }

const char *vkx_uapi_name(size_t index)
{
    return index < vkx_uapi_count() ? vkx_uapi[index].name : NULL;
}

uint64_t vkx_uapi_value(size_t index)
{
    return index < vkx_uapi_count() ? vkx_uapi[index].value : 0;
}

int vkx_uapi_lookup(const char *name, uint64_t *out)
{
    size_t i;
    if (name == NULL || out == NULL)
        return -EINVAL;
    for (i = 0; i < vkx_uapi_count(); i++) {
        if (strcmp(vkx_uapi[i].name, name) == 0) {
            *out = vkx_uapi[i].value;
            return 0;
        }
    }
    return -ENOENT;
}

int vkx_uapi_system_headers(void) { return vkx_sys_headers; }

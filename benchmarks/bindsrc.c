// LD_PRELOAD shim of benchmarks/two_nodes.py: every connect() to a loopback address (127.0.0.0/8, or its IPv4-mapped
// IPv6 form) from a socket not yet bound is first bound to DGC_BIND_ADDR (port 0), so a rank's connections leave from its node's address.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*connect_fn)(int, const struct sockaddr*, socklen_t);

int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  static connect_fn real = NULL;
  if (!real) real = (connect_fn)dlsym(RTLD_NEXT, "connect");
  const char* src = getenv("DGC_BIND_ADDR");
  if (src && addr) {
    struct sockaddr_storage cur;
    socklen_t cur_len = sizeof(cur);
    int unbound = getsockname(fd, (struct sockaddr*)&cur, &cur_len) == 0;
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
      const struct sockaddr_in* in = (const struct sockaddr_in*)addr;
      unbound = unbound && ((struct sockaddr_in*)&cur)->sin_port == 0;
      if (unbound && (ntohl(in->sin_addr.s_addr) >> 24) == 127) {
        struct sockaddr_in b;
        memset(&b, 0, sizeof(b));
        b.sin_family = AF_INET;
        if (inet_pton(AF_INET, src, &b.sin_addr) == 1) bind(fd, (struct sockaddr*)&b, sizeof(b));
      }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
      const struct sockaddr_in6* in6 = (const struct sockaddr_in6*)addr;
      unbound = unbound && ((struct sockaddr_in6*)&cur)->sin6_port == 0;
      const unsigned char* a = in6->sin6_addr.s6_addr;
      static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
      if (unbound && memcmp(a, mapped, 12) == 0 && a[12] == 127) {
        struct sockaddr_in6 b;
        memset(&b, 0, sizeof(b));
        b.sin6_family = AF_INET6;
        char text[64] = "::ffff:";
        strncat(text, src, sizeof(text) - 8);
        if (inet_pton(AF_INET6, text, &b.sin6_addr) == 1) bind(fd, (struct sockaddr*)&b, sizeof(b));
      }
    }
  }
  return real(fd, addr, len);
}

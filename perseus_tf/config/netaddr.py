"""Network addresses of this machine: resolving a name, the address that
routes to a peer, an interface's address, and whether an address is ours."""

import socket
import time

from perseus_tf.config.settings import ConfigError

# How long a store address that does not resolve (yet) is retried: a
# Kubernetes service name appears in DNS only once its pod is up.
RESOLVE_WAIT_S = 60.0


def resolve(addr, what):
    """addr's IPv4 address, retried for RESOLVE_WAIT_S while it does not resolve."""
    deadline = time.monotonic() + RESOLVE_WAIT_S
    while True:
        try:
            return socket.gethostbyname(addr)
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{what} {addr!r} does not resolve to an IPv4 address on "
                                  f"this host ({e}); it must be an address or a host name "
                                  "that every rank can resolve") from None
            time.sleep(1.0)


def is_loopback_ip(ip):
    return ip.startswith("127.")


def route_address(addr, port=9):
    """This machine's IPv4 address that routes to addr: the source address of
    a UDP socket connected there (which sends nothing). Unlike
    gethostbyname(gethostname()) it tells apart network namespaces, which
    share one host name, and hosts whose name maps to 127.0.1.1."""
    ip = resolve(addr, "the rendezvous address")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((ip, port or 9))
        except OSError as e:
            raise ConfigError(f"no route from this host to the rendezvous address {addr!r} "
                              f"({ip}): {e.strerror}; set PERSEUS_HOST_ADDR to this host's "
                              "address on the job's network") from None
        return sock.getsockname()[0]


def interface_address(name):
    """The IPv4 address of network interface `name` (e.g. "eth0")."""
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            names = sorted(n for _, n in socket.if_nameindex())
            raise ConfigError(f"PERSEUS_GLOO_NETWORK_INTERFACE={name!r} is not an interface "
                              f"with an IPv4 address on this host: it must be one of "
                              f"{', '.join(names)}") from None
    return socket.inet_ntoa(packed[20:24])


def can_bind(ip):
    """True if ip is assigned to this machine (only those can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True

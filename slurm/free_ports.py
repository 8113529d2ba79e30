"""Print N distinct ports free on this node now, one per line, for servers the caller starts right after
(torch's rendezvous, Ray's head and agents): `python slurm/free_ports.py N`.

They are taken below the kernel's ephemeral range. A port from that range, which is what binding port 0
gives, can be handed to any outgoing connection on the node between this pick and the server's bind;
this project's CI saw exactly that (EADDRINUSE at a rendezvous). A port below the range is only ever
taken by a program that binds it by number. They start at 20000, above Ray's worker ports (10002-19999 by
default, which Ray refuses to see another of its components use). Falls back to the kernel's pick when
there is no room in between.
"""
import random
import socket
import sys

FIRST = 20000


def free_ports(n: int) -> list[int]:
    """N distinct ports free now (released on return), as the module's docstring says."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    candidates = random.SystemRandom().sample(range(FIRST, low), k=min(2000, max(0, low - FIRST)))
    held = []  # open together, so the ports differ
    for port in candidates:
        if len(held) == n:
            break
        s = socket.socket()
        try:
            s.bind(("", port))
        except OSError:  # in use, or lingering from a recent connection
            s.close()
            continue
        held.append(s)
    while len(held) < n:
        s = socket.socket()
        s.bind(("", 0))
        held.append(s)
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


if __name__ == "__main__":
    print("\n".join(map(str, free_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 1))))

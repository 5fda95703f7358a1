"""The first process inside an agent's sandbox: it builds the agent's view (with `unshare`), forwards its model
endpoint, starts the agent and reaps what it leaves.

Run by `namespaces.py` as `python -I -S init.py FD` inside fresh pid, mount and network namespaces (made by
bubblewrap or by util-linux's `unshare`); it imports nothing of `training` (nor site-packages), so the agent's view
needs nothing of the trainer's. `FD` is a pipe it reads its spec from, as JSON:

- `view` (the `unshare` backend only; bubblewrap builds it from its own flags): `root`, an empty directory the new
  root is built in, and `hidden`, `binds` as `sandbox.SandboxView` holds them. The whole file system is bound
  read-only, without devices and setuid bits; `/tmp` and `/dev/shm` are fresh tmpfs; each hidden directory is an
  empty read-only tmpfs, each hidden file `/dev/null`; the binds (the working directory, read-write) go on top; a
  proc of the new pid namespace, a minimal `/dev`, loopback up; then `chroot`, every capability dropped
  (bounding set included, so an `exec` as uid 0 gets none back) and `no_new_privs`.
- `socket`, `port`: the network namespace has loopback only, so `127.0.0.1:port` (the shim's own port number, so
  the session's base URL is unchanged) is forwarded byte for byte to the shim's socket for this one session.
- `argv`, `env`, `cwd`: the agent.
- `status_fd`: where the agent's wait status is written before this process exits; `watch_fd`: the read end of a
  pipe the trainer holds open, so the sandbox dies with the trainer, however that ends.

When the machine runs out of memory, the kernel's OOM killer takes the sandbox first: this process sets its own
`oom_score_adj` to the maximum (raising it needs no privilege), which every process the agent starts inherits, so an
agent that allocates without bound is killed rather than the trainer.

Every process of the sandbox dies with this one: when it exits, the pid namespace ends (it is its init: `unshare
--fork` and bubblewrap's `--as-pid-1` start it as pid 1), and with it every process the agent started, `setsid`
daemons included. Reaping the agent (and the orphans it leaves) also hands their CPU time up to the trainer's
process, where `perf/cpu_util` counts it.
"""

import ctypes
import errno
import json
import os
import signal
import socket
import struct
import sys
import threading

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # one number on every architecture since Linux 5.12
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
OOM_SCORE_ADJ_MAX = 1000
TMPFS_SIZE = "size=1g"
"""A private /tmp of at most this much memory."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {source} on {target}")


def read_only_tree(path):
    """Every mount under `path` read-only, without devices and setuid bits (`mount_setattr`, recursively)."""
    attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    buf = ctypes.create_string_buffer(attr, len(attr))
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, buf, len(attr)),
           f"mount_setattr {path}")


def build_view(view):
    """The agent's file system under `view["root"]`, then `chroot` into it."""
    root = view["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("/", root, None, MS_BIND | MS_REC)
    read_only_tree(root)
    for path in view["private_tmp"]:
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777," + TMPFS_SIZE)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "mode=755,size=1m")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(f"{root}/dev/shm")
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    for path in view["hidden"]:  # as bubblewrap does: made where a private /tmp left none
        target = root + path
        if os.path.isdir(path) and not os.path.islink(path):
            os.makedirs(target, exist_ok=True)
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
        elif os.path.lexists(path) and not os.path.islink(path):
            if not os.path.lexists(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
            mount("/dev/null", target, None, MS_BIND)
    for source, target, writable in view["binds"]:
        target = root + target
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(source, target, None, MS_BIND | MS_REC)
        if not writable:
            mount(None, target, None, MS_BIND | MS_REC | 32 | MS_RDONLY)  # 32: MS_REMOUNT
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    loopback_up()
    os.chroot(root)
    os.chdir("/")
    drop_privileges()


def loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl  # noqa: PLC0415 - only the unshare backend needs it

        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def drop_privileges():
    """No capability now, none after an `exec` (bounding set empty), and no setuid way back (`no_new_privs`)."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("II", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two empty {effective, permitted, inheritable} sets
    _check(_libc.capset(ctypes.create_string_buffer(header, 8), ctypes.create_string_buffer(data, 24)), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def forward(listener, shim_socket):
    """Each connection to `listener` piped to a new connection to `shim_socket`, both ways, until both close."""
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(shim_socket)
        except OSError:
            client.close()
            continue
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source, sink):
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _die_with_trainer(watch_fd, agent_pid):
    while os.read(watch_fd, 1):
        pass
    os.kill(agent_pid, signal.SIGKILL)
    os._exit(137)


def main():
    with os.fdopen(int(sys.argv[1]), "rb") as f:  # a pipe, not the command line, which other users can read
        spec = json.loads(f.read())
    with open("/proc/self/oom_score_adj", "w") as f:  # first to be killed when memory runs out, children too
        f.write(str(OOM_SCORE_ADJ_MAX))
    if spec.get("view"):
        build_view(spec["view"])
    listener = None
    if spec.get("socket"):
        listener = socket.create_server(("127.0.0.1", spec["port"]), backlog=64)
    pid = os.fork()
    if pid == 0:
        if listener is not None:
            listener.close()
        os.close(spec["status_fd"])
        os.close(spec["watch_fd"])
        try:
            os.chdir(spec["cwd"])
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as e:
            os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {e}\n".encode())
            os._exit(127)
    if listener is not None:
        threading.Thread(target=forward, args=(listener, spec["socket"]), daemon=True).start()
    threading.Thread(target=_die_with_trainer, args=(spec["watch_fd"], pid), daemon=True).start()
    while True:  # reap every orphan (as the namespace's init, they are ours), until the agent itself ends
        reaped, status = os.waitpid(-1, 0)
        if reaped == pid:
            break
    os.write(spec["status_fd"], str(status).encode())
    os._exit(0)


if __name__ == "__main__":
    main()

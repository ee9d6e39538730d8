"""The sandbox's seccomp filter. Every system call is allowed except:

* those that reach beyond a plain program (tracing other processes, mounts, namespaces, kernel modules and
  keyrings, eBPF, io_uring, System V shared memory and message queues, memfd, ...): they fail with EPERM;
* ``socket`` and ``socketpair`` of any family but AF_UNIX (an allow-list: AF_INET, AF_VSOCK, AF_ALG, AF_NETLINK and
  every family a future kernel adds fail with EPERM). The family is an ``int``: the kernel reads the low 32 bits of
  the register and a filter sees all 64, so every rule here compares the low 32 bits only (a family with garbage in
  its upper half is read as what the kernel reads; libseccomp#383);
* a system call of a foreign architecture (x32, i386) kills the process (libseccomp's default for them).

Built with libseccomp (through ``pyseccomp``, a ctypes binding, MIT) once per process (``filter_bytes``) and handed
to bubblewrap as BPF on a pipe (``--seccomp FD``), which installs it right before it starts the sandbox's first
process, with no-new-privileges set."""
from __future__ import annotations

import errno
import socket

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "syslog", "iopl", "ioperm", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "personality", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname",
    "vhangup", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # memory no cgroup sees without one and no rlimit bounds: System V segments outlive their process, memfd pages
    # are not in any address space until mapped
    "shmget", "shmat", "msgget", "memfd_create", "memfd_secret",
)
"""System calls that fail with EPERM in the sandbox."""
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: a ``clone`` with any of them fails (the kernel
reads clone's flags from the low 32 bits, as these masks do)"""
ALLOWED_FAMILIES = (socket.AF_UNIX,)
"""The socket families a program may open (``socket``/``socketpair``)"""
LOW32 = 0xFFFFFFFF


def available() -> str:
    """"" when the filter can be built here, else why not."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError) as e:  # the binding, or libseccomp.so.2 it loads
        return f"libseccomp is not usable ({type(e).__name__}: {e}); pip install pyseccomp, apt install libseccomp2"
    return ""


def _deny_int_unless(f, deny, call: str, arg: int, allowed: int) -> None:
    """Deny ``call`` unless the low 32 bits of argument ``arg`` equal ``allowed``: one rule per way of differing
    (bit 0 not as in ``allowed``, or any other of the 32 bits set where ``allowed`` has it clear...), each a masked
    compare, so the upper half of the register is never read."""
    import pyseccomp as sc

    for bit in range(32):
        m = 1 << bit
        want = allowed & m
        f.add_rule(deny, call, sc.Arg(arg, sc.MASKED_EQ, m, m ^ want))


def build():
    """The filter (a ``pyseccomp.SyscallFilter``)."""
    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (ValueError, OSError):  # a call this kernel's table does not have
            continue
    for flag in CLONE_NEW:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory, out of a filter's reach: glibc
    # falls back to clone, whose flags the rules above see
    assert len(ALLOWED_FAMILIES) == 1, "one family: the rules below allow exactly one value"
    for call in ("socket", "socketpair"):
        _deny_int_unless(f, deny, call, 0, ALLOWED_FAMILIES[0])
    return f


_bytes: list[bytes] = []


def filter_bytes() -> bytes:
    """The filter's BPF program (built once per process)."""
    if not _bytes:
        import tempfile

        with tempfile.TemporaryFile() as fh:
            build().export_bpf(fh)
            fh.seek(0)
            _bytes.append(fh.read())
    return _bytes[0]

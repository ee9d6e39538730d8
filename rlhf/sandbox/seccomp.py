"""The sandbox's seccomp filter: every system call is allowed except those that reach beyond a plain program
(tracing other processes, mounts, namespaces, kernel modules and keyrings, eBPF, raw and network sockets, ...), which
fail with EPERM; a system call of a foreign architecture (x32, i386) kills the process (libseccomp's default for
them). Built with libseccomp (through ``pyseccomp``, a ctypes binding, MIT) and handed to bubblewrap as BPF
(``--seccomp FD``), which installs it right before it starts the program, with no-new-privileges set."""
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
)
"""System calls that fail with EPERM in the sandbox."""
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: a ``clone`` with any of them fails"""


def available() -> str:
    """"" when the filter can be built here, else why not."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError) as e:  # the binding, or libseccomp.so.2 it loads
        return f"libseccomp is not usable ({type(e).__name__}: {e}); pip install pyseccomp, apt install libseccomp2"
    return ""


def write_filter(path: str) -> None:
    """Write the filter's BPF program to ``path`` (for bubblewrap's ``--seccomp``)."""
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
    for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
        f.add_rule(deny, "socket", sc.Arg(0, sc.EQ, family))
    with open(path, "wb") as fh:
        f.export_bpf(fh)

"""Runs untrusted Python (model-written code) against hidden tests in a sandboxed subprocess.

Layers, each of which must fail for anything to escape:

  * a fresh interpreter in isolated mode (`python -I -S`: no site, no user paths, no PYTHON* env)
    with an EMPTY environment, in a fresh temporary directory as cwd (deleted afterwards);
  * rlimits set by the runner before any untrusted code: CPU seconds, address space (memory),
    file size, open files, no core dumps; RLIMIT_NPROC=1 when not root (as root it does not
    bind, which is why the audit hook below blocks fork itself);
  * a Python audit hook (sys.addaudithook, cannot be removed) installed before the untrusted code,
    closed over private copies of everything it uses: it blocks fork/exec/spawn/system/subprocess,
    kill, sockets and name lookups, ctypes (import and dlopen), rlimit changes, frame / gc / trace
    introspection, code-object construction, new audit hooks, symlinks / hard links / device
    nodes, any write, delete, rename, chmod, chdir... outside the temporary directory, reads
    (open, listdir, and stat / lstat / access, which it replaces by audited versions; readlink
    and statvfs refused) outside it and the standard library less site-packages (no access to
    the repository or the installed packages);
  * a disk quota: the parent kills the child once its temporary directory holds disk_mb;
  * a wall-clock deadline; the process runs in its own session and its whole process group is
    SIGKILLed when it ends (strays included), before it is reaped;
  * when `unshare -n` works (root on Linux), a new network namespace without interfaces; as root,
    `setpriv` empties the capability sets (no device nodes, no raising hard rlimits, no mounts,
    no killing other users' processes; no_new_privs) and, when the interpreter is reachable by
    `nobody`, also drops to uid/gid 65534 (then file permissions protect the repository too).
    Each layer is detected once per process and skipped when unavailable.

The verdict never trusts the child: it reports the function's return value per test input as
JSON, and the PARENT compares them with the expected outputs (forging a pass = solving the task).
Limits: audit hooks are not a boundary against native-code exploits (crafted bytecode via
marshal); the OS layers above are the backstop there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

MARKER = "__ddtree_sandbox_result__"

# The trusted part of the child. It reads job.json, sets rlimits, installs the audit hook, then
# runs the untrusted code and the test inputs, and writes one MARKER line to a saved stdout fd.
RUNNER = r'''
import builtins, json, os, posix, resource, sys

def _setup():
    with open("job.json") as f:
        job = json.load(f)
    lim = job["limits"]
    R = resource
    R.setrlimit(R.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    R.setrlimit(R.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"]))
    R.setrlimit(R.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"]))
    R.setrlimit(R.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    if os.getuid() != 0:
        R.setrlimit(R.RLIMIT_NPROC, (1, 1))
    return job

def _install(tmp, read_roots, deny_roots, blocked_events, blocked_imports):
    _str, _bytes, _int, _type, _tuple = str, bytes, int, type, tuple
    _PermissionError, _any, _len = PermissionError, any, len
    _getcwd = posix.getcwd
    _W = (posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_APPEND | posix.O_TRUNC)
    _blocked = frozenset(blocked_events)
    _blocked_imports = frozenset(blocked_imports)
    _frames = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"))
    _roots = _tuple(read_roots)
    _deny = _tuple(deny_roots)
    _tmp = tmp
    _split, _join, _decode = _str.split, _str.join, _bytes.decode
    _startswith = _str.startswith

    def deny(event, what=""):
        raise _PermissionError("sandbox: " + event + " blocked" + (" (" + what + ")" if what else ""))

    def norm(path, event):
        t = _type(path)
        if t is _bytes:
            path = _decode(path, "utf-8", "surrogateescape")
        elif t is not _str:
            deny(event, "only str/bytes paths are allowed")
        if not _startswith(path, "/"):
            path = _getcwd() + "/" + path
        parts = []
        for seg in _split(path, "/"):
            if seg == "" or seg == ".":
                continue
            if seg == "..":
                if parts:
                    parts.pop()
                continue
            parts.append(seg)
        return "/" + _join("/", parts)

    def under(p, root):
        return p == root or _startswith(p, root + "/")

    def writable(path, event):
        if _type(path) is _int:
            deny(event, "file descriptor")
        p = norm(path, event)
        if not under(p, _tmp):
            deny(event, p)

    def readable(path, event):
        if path is None or _type(path) is _int:
            return
        p = norm(path, event)
        if under(p, _tmp):
            return
        for r in _deny:
            if under(p, r):
                deny(event, p)
        for r in _roots:
            if under(p, r):
                return
        deny(event, p)

    write_events = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
                    "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                    "os.setxattr": (0,), "os.removexattr": (0,), "os.chdir": (0,),
                    "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,),
                    "shutil.copystat": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1),
                    "shutil.chown": (0,), "shutil.make_archive": (0,),
                    "shutil.unpack_archive": (1,)}
    read_events = {"os.listdir": (0,), "os.scandir": (0,), "os.walk": (0,), "os.fwalk": (0,),
                   "glob.glob": (0,), "shutil.copyfile": (0,), "shutil.copytree": (0,)}

    def hook(event, args):
        if event in _blocked:
            deny(event)
        if event == "open":
            path, mode, flags = args
            if _type(path) is _int:
                return
            if (flags & _W) or (mode is not None and _any(c in mode for c in "wax+")):
                writable(path, "open for writing")
            else:
                readable(path, "open")
            return
        if event == "import":
            if args[0] in _blocked_imports:
                deny(event, args[0])
            return
        if event == "object.__getattr__":
            if _len(args) > 1 and args[1] in _frames:
                deny(event, args[1])
            return
        idx = write_events.get(event)
        if idx is not None:
            for i in idx:
                if i < _len(args):
                    writable(args[i], event)
        idx = read_events.get(event)
        if idx is not None:
            for i in idx:
                if i < _len(args):
                    readable(args[i], event)

    sys.addaudithook(hook)
    _guard_metadata()

def _guard_metadata():
    """stat and friends raise no audit event: replace them by versions that open the path with
    O_PATH (an audited open, so the read roots apply) and fstat the descriptor. They keep no
    reference to the originals; readlink and statvfs are refused."""
    _open, _fstat, _close = posix.open, posix.fstat, posix.close
    O_PATH, O_NOFOLLOW = getattr(posix, "O_PATH", 0), posix.O_NOFOLLOW
    _PermissionError = PermissionError

    def stat(path, *, dir_fd=None, follow_symlinks=True):
        if type(path) is int:
            return _fstat(path)
        if dir_fd is not None:
            raise _PermissionError("sandbox: stat with dir_fd blocked")
        fd = _open(path, posix.O_RDONLY | O_PATH | (0 if follow_symlinks else O_NOFOLLOW))
        try:
            return _fstat(fd)
        finally:
            _close(fd)

    def lstat(path, *, dir_fd=None):
        return stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def access(path, mode, *, dir_fd=None, effective_ids=False, follow_symlinks=True):
        try:
            st = stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        except OSError:
            return False
        return not (mode & posix.X_OK) or bool(st.st_mode & 0o111)

    def refused(*args, **kwargs):
        raise _PermissionError("sandbox: readlink / statvfs blocked")

    for mod in (posix, os):
        mod.stat, mod.lstat, mod.access = stat, lstat, access
        mod.readlink, mod.statvfs = refused, refused

def _main():
    job = _setup()
    out_fd = os.dup(1)
    write, exit_, dumps = os.write, os._exit, json.dumps
    code_text, entry, cases = job["code"], job["entry"], job["cases"]
    result = {"load_error": None, "cases": []}

    def describe(e):
        try:
            return type(e).__name__ + ": " + str(e)[:300]
        except BaseException:
            return "unprintable exception"

    def finish():
        try:
            text = dumps(result, default=repr)
        except BaseException as e:
            text = dumps({"load_error": "result not serialisable: " + describe(e), "cases": []})
        write(out_fd, ("\n" + job["marker"] + " " + text + "\n").encode())
        exit_(0)

    try:
        code = compile(code_text, "<solution>", "exec")
    except BaseException as e:
        result["load_error"] = describe(e)
        finish()
    _install(job["tmp"], job["read_roots"], job["deny_roots"], job["blocked_events"],
             job["blocked_imports"])
    ns = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(code, ns)
        fn = ns.get(entry)
        if not callable(fn):
            raise NameError("the code defines no function " + repr(entry))
    except BaseException as e:
        result["load_error"] = describe(e)
        finish()
    for args in cases:
        try:
            value = fn(*args)
            dumps(value)
            result["cases"].append({"ok": True, "value": value})
        except BaseException as e:
            result["cases"].append({"ok": False, "error": describe(e)})
    finish()

_main()
'''

BLOCKED_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
    "os.killpg", "os.unshare", "os.setns", "os.link", "os.symlink", "os.mknod", "os.mkfifo",
    "os.pidfd_open", "os.startfile", "os.add_dll_directory", "pty.spawn", "signal.pthread_kill",
    "subprocess.Popen", "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto",
    "socket.sendmsg", "socket.sethostname", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
    "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.call_function", "ctypes.addressof",
    "ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr", "resource.setrlimit",
    "resource.prlimit", "sys.addaudithook", "sys._getframe", "sys._current_frames",
    "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.monitoring.register_callback",
    "sys.remote_exec", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
    "webbrowser.open", "urllib.Request", "http.client.connect", "ftplib.connect",
    "smtplib.connect", "poplib.connect", "imaplib.open", "nntplib.connect",
)
BLOCKED_IMPORTS = (
    "ctypes", "_ctypes", "_posixsubprocess", "_testcapi", "_testinternalcapi", "_testbuffer",
    "_testimportmultiple", "_testmultiphase", "_testsinglephase", "_xxsubinterpreters",
    "_xxinterpchannels", "_interpreters", "_interpchannels", "_xxtestfuzz", "_ctypes_test",
    "posix",  # re-importing posix would bring back the unguarded stat
)


@dataclasses.dataclass
class SandboxResult:
  passed: bool                    # every case returned its expected value
  status: str                     # "pass", "wrong answer", "timeout", "memory limit", "blocked: ..."
  detail: str                     # first failure, human readable
  cases: list                     # per case: {"ok", "value" | "error", "expected", "pass"}
  seconds: float
  returncode: int | None
  isolation: tuple[str, ...]      # layers in force: rlimits, audit, netns, nocaps, nobody
  stdout: str = ""
  stderr: str = ""


@functools.cache
def _probe(prefix: tuple[str, ...]) -> bool:
  """Does `prefix + [python, -I, -S, -c, pass]` run? (cached per process)"""
  try:
    return subprocess.run(list(prefix) + [sys.executable, "-I", "-S", "-c", "pass"], env={},
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=20).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def isolation_prefix(network_namespace: bool = True, drop_privileges: bool = True):
  """(command prefix, layer names) for the OS-level layers available here."""
  prefix, layers = [], []
  unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
  if network_namespace and unshare and _probe((unshare, "-n")):
    prefix += [unshare, "-n"]
    layers.append("netns")
  if os.geteuid() == 0 and setpriv:
    nocaps = ["--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
    nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"]
    if drop_privileges and _probe(tuple(prefix + [setpriv] + nobody + nocaps)):
      prefix += [setpriv] + nobody + nocaps
      layers += ["nobody", "nocaps"]
    elif _probe(tuple(prefix + [setpriv] + nocaps)):
      prefix += [setpriv] + nocaps
      layers.append("nocaps")
  return prefix, tuple(layers)


def _read_roots() -> tuple[list[str], list[str]]:
  """(where the child may read besides its temp dir, what inside those it may not): the
  standard library of this interpreter (the child runs with -I -S, so sys.path is the stdlib
  only), less the site-packages of this interpreter and of any venv on top of it."""
  import site  # pylint: disable=import-outside-toplevel
  import sysconfig  # pylint: disable=import-outside-toplevel
  paths = sysconfig.get_paths()
  roots = {paths["stdlib"], paths["platstdlib"], os.path.dirname(os.__file__)}
  roots |= {os.path.join(r, "lib-dynload") for r in list(roots)}
  deny = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
  deny |= {os.path.join(r, d) for r in roots for d in ("site-packages", "dist-packages")}
  real = lambda ps: sorted({os.path.realpath(p) for p in ps if os.path.isdir(p)})
  return real(roots), real(deny)


def _jsonable(x):
  return json.loads(json.dumps(x))


def _classify(err: str) -> str:
  if err.startswith("MemoryError"):
    return "memory limit"
  if err.startswith("PermissionError: sandbox:"):
    return "blocked: " + err.split("sandbox:", 1)[1].strip()
  if err.startswith(("SyntaxError", "IndentationError", "TabError")):
    return "syntax error"
  if err.startswith("RecursionError"):
    return "recursion limit"
  return "error: " + err.split(":", 1)[0]


def run_tests(code: str, entry: str, cases: Sequence[Sequence[Any]], expected: Sequence[Any], *,
              timeout_s: float = 5.0, memory_mb: int = 512, fsize_mb: int = 16, nofile: int = 64,
              disk_mb: int = 64, network_namespace: bool = True, drop_privileges: bool = True,
              startup_grace_s: float = 2.0) -> SandboxResult:
  """Runs `code` (untrusted), calls `entry(*case)` for each case in the sandbox and compares the
  returned values with `expected` here (after a JSON round trip: tuples compare as lists).
  The temporary directory may hold disk_mb in all: past that the child is killed."""
  if len(cases) != len(expected):
    raise ValueError("cases and expected differ in length")
  tmp = os.path.realpath(tempfile.mkdtemp(prefix="ddtree_sandbox_"))
  prefix, layers = isolation_prefix(network_namespace, drop_privileges)
  t0 = time.perf_counter()
  try:
    read_roots, deny_roots = _read_roots()
    job = {"code": code, "entry": entry, "cases": _jsonable([list(c) for c in cases]),
           "marker": MARKER, "tmp": tmp, "read_roots": read_roots, "deny_roots": deny_roots,
           "blocked_events": BLOCKED_EVENTS, "blocked_imports": BLOCKED_IMPORTS,
           "limits": {"cpu_s": max(1, int(-(-timeout_s // 1))),
                      "as_bytes": int(memory_mb) << 20, "fsize_bytes": int(fsize_mb) << 20,
                      "nofile": int(nofile)}}
    with open(os.path.join(tmp, "job.json"), "w") as f:
      json.dump(job, f)
    runner = os.path.join(tmp, "_runner.py")
    with open(runner, "w") as f:
      f.write(RUNNER)
    if "nobody" in layers:
      for p in (tmp, runner, os.path.join(tmp, "job.json")):
        os.chown(p, 65534, 65534)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
      proc = subprocess.Popen(prefix + [sys.executable, "-I", "-S", runner], cwd=tmp, env={},
                              stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
                              start_new_session=True)
      over_quota = lambda: _tree_bytes(tmp) > (int(disk_mb) << 20)
      ended = _wait_unreaped(proc.pid, timeout_s + startup_grace_s, over_quota)
      timed_out = ended is None
      quota_hit = ended == "quota" or over_quota()  # also what a fast child wrote, then left
      try:  # the leader is not reaped yet, so its process group id cannot have been reused
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      rc = proc.wait()
      stdout, stderr = _read(out), _read(err)
      full = max(os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size) >= job[
          "limits"]["fsize_bytes"]
    seconds = time.perf_counter() - t0
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  if quota_hit:
    return SandboxResult(False, "disk quota", f"the temporary directory passed {disk_mb} MB",
                         [], seconds, rc, ("rlimits", "audit", "quota") + layers, stdout[-4000:],
                         stderr[-4000:])
  return _verdict(stdout, stderr, rc, timed_out, full, expected, seconds,
                  ("rlimits", "audit", "quota") + layers)


def _tree_bytes(root: str) -> int:
  """Bytes of the files under root (what the child wrote)."""
  total = 0
  for folder, _, names in os.walk(root):
    for n in names:
      try:
        total += os.lstat(os.path.join(folder, n)).st_size
      except OSError:
        pass
  return total


def _wait_unreaped(pid: int, timeout: float, over_quota=None):
  """Waits until `pid` exits WITHOUT reaping it: "exited", "quota" once over_quota() (checked
  every ~50 ms) is true, or None on timeout."""
  deadline = time.monotonic() + timeout
  delay, next_check = 0.002, 0.0
  while True:
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is not None and info.si_pid:
      return "exited"
    now = time.monotonic()
    if over_quota is not None and now >= next_check:
      if over_quota():
        return "quota"
      next_check = now + 0.05
    if now > deadline:
      return None
    time.sleep(delay)
    delay = min(delay * 2, 0.05)


def _read(f, limit: int = 1 << 20) -> str:
  f.seek(0)
  return f.read(limit).decode("utf-8", "replace")


def _verdict(stdout, stderr, rc, timed_out, output_full, expected, seconds,
             layers) -> SandboxResult:
  make = lambda passed, status, detail, cases=(): SandboxResult(
      passed, status, detail, list(cases), seconds, rc, layers, stdout[-4000:], stderr[-4000:])
  if timed_out:
    return make(False, "timeout", f"killed after {seconds:.1f} s (wall clock)")
  if output_full:
    return make(False, "output limit", "stdout/stderr reached the file size limit")
  if rc is not None and rc < 0:
    sig = -rc
    names = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "file size limit",
             signal.SIGKILL: "killed", signal.SIGSEGV: "crashed"}
    return make(False, names.get(sig, "crashed"), f"terminated by signal {signal.Signals(sig).name}")
  lines = [l for l in stdout.splitlines() if l.startswith(MARKER + " ")]
  if not lines:
    return make(False, "no result", f"exit code {rc} without a result; stderr: {stderr[-300:]!r}")
  try:
    res = json.loads(lines[-1][len(MARKER) + 1:])
  except json.JSONDecodeError:
    return make(False, "no result", "unparseable result line")
  if res.get("load_error"):
    return make(False, _classify(res["load_error"]), res["load_error"])
  cases = res.get("cases") or []
  if len(cases) != len(expected):
    return make(False, "no result", f"{len(cases)} results for {len(expected)} tests")
  first = None
  for c, want in zip(cases, expected):
    want = _jsonable(want)
    c["expected"] = want
    c["pass"] = bool(c.get("ok")) and c.get("value") == want
    if not c["pass"] and first is None:
      first = c
  if first is None:
    return make(True, "pass", "", cases)
  if not first.get("ok"):
    return make(False, _classify(first.get("error", "")), first.get("error", ""), cases)
  return make(False, "wrong answer", f"returned {first.get('value')!r}, expected "
              f"{first['expected']!r}", cases)

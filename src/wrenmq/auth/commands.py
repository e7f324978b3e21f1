"""`wrenmq passwd` (mosquitto_passwd's semantics) and `wrenmq reload` (SIGHUP the broker)."""

import getpass
import os
import signal
import sys
import warnings

from .passwords import (
    DEFAULT_ITERATIONS, MAX_LEN, PasswordFileError, check_username, delete_user, read_lines,
    set_password, write_lines,
)

PASSWD_HELP = """\
Manage a Mosquitto-format password file (the same format and $7$ hashes as mosquitto_passwd).

  wrenmq passwd [-c] FILE USER           add or update USER, asking for the password twice
  wrenmq passwd [-c] -b FILE USER PASS   the same with the password on the command line
  wrenmq passwd -D FILE USER             delete USER

Without -c the file must exist; with -c it is created (mode 0600) or overwritten.
Other lines, comments included, are kept; the file is replaced atomically.
"""


def _err(msg):
    print(f"Error: {msg}", file=sys.stderr)
    return 1


def add_passwd_parser(sub):
    import argparse

    p = sub.add_parser("passwd", help="manage a Mosquitto-format password file",
                       description=PASSWD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", dest="create", action="store_true",
                   help="create a new password file (an existing one is overwritten)")
    p.add_argument("-b", dest="batch", action="store_true",
                   help="batch mode: the password is given on the command line")
    p.add_argument("-D", dest="delete", action="store_true", help="delete the user")
    p.add_argument("-I", dest="iterations", type=int, default=DEFAULT_ITERATIONS, metavar="N",
                   help=f"PBKDF2 iterations for the new hash (default {DEFAULT_ITERATIONS}, "
                        "mosquitto_passwd's)")
    p.add_argument("file", metavar="FILE", help="the password file")
    p.add_argument("user", metavar="USER", help="the user name")
    p.add_argument("password", metavar="PASSWORD", nargs="?", help="with -b: the password (else asked for)")
    p.set_defaults(func=passwd_main)
    return p


def _prompt():
    """Ask twice without echo (stdin is read when there is no terminal)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", getpass.GetPassWarning)
        try:
            first = getpass.getpass("Password: ")
            if not first:
                _err("Empty password.")
                return None
            again = getpass.getpass("Reenter password: ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            _err("No password given.")
            return None
    if first != again:
        _err("Passwords do not match.")
        return None
    return first


def passwd_main(args):
    if args.create and args.delete:
        return _err("-c and -D cannot be used together.")
    if args.batch and args.delete:
        return _err("-b and -D cannot be used together.")
    if args.batch and args.password is None:
        return _err("-b needs the password on the command line.")
    if not args.batch and args.password is not None:
        return _err("a password on the command line needs -b.")
    if args.iterations < 1:
        return _err("Number of iterations must be > 0.")
    problem = check_username(args.user)
    if problem:
        return _err(problem)
    path = args.file
    lines = []
    if not args.create:
        try:
            lines = read_lines(path)
        except OSError as e:
            return _err(f"Unable to open password file {path}. {e.strerror or e}.")
        except UnicodeDecodeError:
            return _err(f"Password file {path} is not valid UTF-8.")
        except PasswordFileError as e:
            return _err(str(e))
    if args.delete:
        lines, found = delete_user(lines, args.user)
        if not found:
            print(f"Warning: User {args.user} not found in password file.", file=sys.stderr)
            return 1
    else:
        if args.batch:
            password = os.fsencode(args.password)  # the bytes the user typed, like argv in C
        else:
            password = _prompt()
            if password is None:
                return 1
            password = password.encode()
        if len(password) > MAX_LEN:
            return _err("Password must be less than 65536 characters long.")
        lines, _ = set_password(lines, args.user, password, args.iterations)
    try:
        write_lines(path, lines, create=args.create)
    except OSError as e:
        return _err(f"Unable to open file {path} for writing. {e.strerror or e}.")
    return 0


# --- reload ---------------------------------------------------------------------------

def add_reload_parser(sub):
    p = sub.add_parser(
        "reload", help="make a running broker re-read its password and ACL files (SIGHUP)",
        description="Send SIGHUP to a running `wrenmq serve`: it re-reads the password and ACL "
                    "files (a file that cannot be used leaves the old rules in force; see the "
                    "broker's log). Which broker: --pid, else --pid-file, else the pid_file of "
                    "[broker] in --config.")
    p.add_argument("--pid", type=int, metavar="PID", help="process id of the broker")
    p.add_argument("--pid-file", metavar="FILE", help="file holding the broker's process id")
    p.add_argument("--config", metavar="FILE", help="the broker's configuration ([broker] pid_file)")
    p.set_defaults(func=reload_main)
    return p


def write_pid_file(path):
    """Write our process id to `path`; refuse (FileExistsError) if it names a wrenmq that
    is still running: a second broker started by mistake must not take the first one's
    file, or `wrenmq reload` and service managers would signal the wrong process."""
    try:
        with open(path) as fh:
            other = int(fh.read().strip())
    except (OSError, ValueError):
        other = 0
    if other > 0 and other != os.getpid() and _is_running(other) and _is_wrenmq(other):
        raise FileExistsError(f"it names wrenmq process {other}, which is running")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def remove_pid_file(path):
    """Remove the pid file if it is still ours."""
    try:
        with open(path) as fh:
            if fh.read().strip() != str(os.getpid()):
                return
        os.unlink(path)
    except OSError:
        pass


def _is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _is_wrenmq(pid):
    """False if /proc says the process is something else (a stale pid file, pid reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc")  # no /proc at all: cannot tell
    except OSError:
        return True
    return b"wrenmq" in cmdline


def reload_main(args):
    pid = args.pid
    source = "--pid"
    if pid is None:
        pid_file = args.pid_file
        source = "--pid-file"
        if pid_file is None and args.config:
            from ..config import ConfigError, load
            try:
                pid_file = load(args.config).broker.pid_file
            except ConfigError as e:
                print(f"wrenmq: {e}", file=sys.stderr)
                return 2
            source = f"pid_file of {args.config}"
            if not pid_file:
                print(f"wrenmq reload: {args.config} sets no [broker] pid_file; give --pid",
                      file=sys.stderr)
                return 2
        if pid_file is None:
            print("wrenmq reload: which broker? give --pid, --pid-file or --config", file=sys.stderr)
            return 2
        try:
            with open(pid_file) as fh:
                pid = int(fh.read().strip())
        except OSError as e:
            print(f"wrenmq reload: cannot read {pid_file}: {e.strerror or e} (is the broker running?)",
                  file=sys.stderr)
            return 1
        except ValueError:
            print(f"wrenmq reload: {pid_file} does not hold a process id", file=sys.stderr)
            return 1
    if pid <= 0:
        print(f"wrenmq reload: bad process id {pid}", file=sys.stderr)
        return 2
    if not _is_wrenmq(pid):
        print(f"wrenmq reload: process {pid} ({source}) is not wrenmq; not signalling it",
              file=sys.stderr)
        return 1
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        print(f"wrenmq reload: no process {pid} ({source}); is the broker running?", file=sys.stderr)
        return 1
    except PermissionError:
        print(f"wrenmq reload: not allowed to signal process {pid}", file=sys.stderr)
        return 1
    print(f"sent SIGHUP to wrenmq (pid {pid}); the broker's log says whether the files were reloaded")
    return 0

"""Which modules the install compiles, and when their Python source is run instead.

setup.py compiles these modules with Cython where a C compiler is there; the Python
file stays the one truth of what they do. The source is imported instead of the
extension when `WRENMQ_PURE_PYTHON=1` (to compare, to debug, to run the tests both
ways) and when the extension is older than its source: an edited module is never
shadowed by a stale build (`make test`/`make run` rebuild it). That check is for a
working tree: in an installed package (site-packages: a wheel, `pip install .`) the
files' times are the install's, in whatever order the installer wrote them, and nobody
edits them, so the extension there is used as it is.
"""

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import warnings

COMPILED_MODULES = ("wrenmq.mqtt.codec", "wrenmq.store._encode", "wrenmq.store._epoch")


class _SourceWhenStale:
    """A meta path finder consulted only for COMPILED_MODULES."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in COMPILED_MODULES or not path:
            return None
        base = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, base + ".py")
            if not os.path.exists(source):
                continue
            if os.environ.get("WRENMQ_PURE_PYTHON") != "1":
                if _installed(folder):
                    return None  # the normal import: the extension if the install built one
                built = [os.path.join(folder, base + suffix)
                         for suffix in importlib.machinery.EXTENSION_SUFFIXES]
                built = [b for b in built if os.path.exists(b)]
                if not built:
                    return None  # nothing compiled: the normal import finds the source
                if os.path.getmtime(built[0]) >= os.path.getmtime(source):
                    return None  # the normal import picks the extension
                warnings.warn(f"{built[0]} is older than {source}: running the source "
                              "(reinstall to rebuild the extension)", stacklevel=2)
            return importlib.util.spec_from_file_location(fullname, source)
        return None


def _installed(folder):
    """Whether `folder` is in the interpreter's site-packages (an installed copy)."""
    paths = sysconfig.get_paths()
    folder = os.path.realpath(folder)
    for key in ("purelib", "platlib"):
        root = os.path.realpath(paths[key])
        if folder == root or folder.startswith(root + os.sep):
            return True
    return False


def install():
    if not any(isinstance(f, _SourceWhenStale) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceWhenStale())


def compiled(module):
    """True if `module` runs as a compiled extension."""
    return not module.__file__.endswith(".py")

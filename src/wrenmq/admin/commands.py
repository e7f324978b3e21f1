"""The command line of this package: `wrenmq admin token`, `wrenmq top`, `wrenmq bench`."""

import argparse
import os
import sys

from .tokens import NAME, TokenFileError, new_token, read_tokens, token_hash, write_tokens

TOKEN_HELP = """\
API tokens of an admin listener (its `token_file`). A token is shown once, when it is made;
the file keeps its SHA-256 only. Callers send it as `Authorization: Bearer <token>`.

  wrenmq admin token add NAME --file FILE [--read-only]   make a token (replaces NAME's)
  wrenmq admin token list --file FILE                      names and scopes
  wrenmq admin token revoke NAME --file FILE               remove NAME's token

The listener re-reads the file when it changes: no reload needed.
"""


def add_parsers(sub):
    a = sub.add_parser("admin", help="admin listener tools (API tokens)")
    asub = a.add_subparsers(dest="admin_command", metavar="ACTION")
    t = asub.add_parser("token", help="make, list and revoke API tokens", description=TOKEN_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = t.add_subparsers(dest="token_command", metavar="ACTION")
    add = tsub.add_parser("add", help="make a token and print it")
    add.add_argument("name", help="a name for the token (unique in the file)")
    add.add_argument("--file", required=True, metavar="FILE", help="the listener's token_file")
    add.add_argument("--read-only", action="store_true", help="the token may only read (GET)")
    add.set_defaults(func=_token_add)
    ls = tsub.add_parser("list", help="the tokens' names and scopes")
    ls.add_argument("--file", required=True, metavar="FILE", help="the listener's token_file")
    ls.set_defaults(func=_token_list)
    rv = tsub.add_parser("revoke", help="remove a token")
    rv.add_argument("name", help="the token to revoke")
    rv.add_argument("--file", required=True, metavar="FILE", help="the listener's token_file")
    rv.set_defaults(func=_token_revoke)

    from .top import add_parser as add_top
    add_top(sub)
    from .loadtest import add_parser as add_bench
    add_bench(sub)


def _err(msg):
    print(f"wrenmq: {msg}", file=sys.stderr)
    return 1


def _token_add(args):
    if not NAME.match(args.name):
        return _err(f"token name {args.name!r}: letters, digits, '-' and '_' only (at most 64)")
    try:
        tokens = read_tokens(args.file)
    except TokenFileError as e:
        return _err(str(e))
    token = new_token(args.name)
    tokens[args.name] = ("read" if args.read_only else "write", token_hash(token))
    try:
        write_tokens(args.file, tokens)
    except OSError as e:
        return _err(f"cannot write {args.file}: {e.strerror or e}")
    print(token)
    print(f"(token {args.name!r}, {'read-only' if args.read_only else 'read-write'}, saved in "
          f"{args.file}; this is the only time it is shown)", file=sys.stderr)
    return 0


def _token_list(args):
    try:
        tokens = read_tokens(args.file)
    except TokenFileError as e:
        return _err(str(e))
    if not os.path.exists(args.file):
        return _err(f"{args.file}: no such file")
    for name, (scope, _) in sorted(tokens.items()):
        print(f"{name}\t{scope}")
    return 0


def _token_revoke(args):
    try:
        tokens = read_tokens(args.file)
    except TokenFileError as e:
        return _err(str(e))
    if tokens.pop(args.name, None) is None:
        return _err(f"no token named {args.name!r} in {args.file}")
    try:
        write_tokens(args.file, tokens)
    except OSError as e:
        return _err(f"cannot write {args.file}: {e.strerror or e}")
    print(f"revoked {args.name}", file=sys.stderr)
    return 0

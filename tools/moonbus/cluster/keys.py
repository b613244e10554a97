"""`moonbus keys`: API keys of a cluster, stored hashed (services/gateway/tenants.py reads them).

  moonbus keys add --tenant acme [--max-concurrent 8] [--tokens-per-minute 200000] [--shared-cache] [--operator] [--label ci]
      prints the new key once (only its SHA-256 is kept)
  moonbus keys list                 tenants, labels and the first characters of each hash
  moonbus keys revoke --label ci    (or --tenant acme, or --hash 3fa2...)

Rotation: add a new key for the tenant, move its clients over, revoke the old one. Gateways
re-read the file when it changes: no restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common.config import default_home
from common.security import hash_key, new_api_key, open_own


def default_file() -> Path:
    return default_home() / "secrets" / "api-keys.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("add", "list", "revoke"))
    parser.add_argument("--file", type=Path, default=None, help="the key file (default ./.moonbus/secrets/api-keys.json)")
    parser.add_argument("--tenant", help="add: whose key it is; revoke: every key of this tenant")
    parser.add_argument("--label", default="", help="a name for the key (add), or which key to revoke")
    parser.add_argument("--hash", default="", help="revoke: the key whose hash starts with this")
    parser.add_argument("--max-concurrent", type=int, default=None, help="requests in flight for the tenant")
    parser.add_argument("--tokens-per-minute", type=int, default=None, help="prompt + completion tokens per minute")
    parser.add_argument("--shared-cache", action="store_true", help="the tenant shares the common cache namespace")
    parser.add_argument("--operator", action="store_true",
                        help="the key sees every tenant's routing decisions on /dashboard/state (others: their own)")


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["keys"] if path.exists() else []


def save(path: Path, keys: list[dict]) -> None:
    """Atomically (gateways re-read it when it changes); a new file is readable by its owner only,
    an existing one keeps its mode (compose's is readable by the containers' user). Never through
    a link: one at the temporary name is refused (open_own), one at the file's is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(path).st_mode & 0o777 if path.is_file() and not path.is_symlink() else 0o600
    tmp = path.with_name(f".{path.name}.tmp")
    fd = open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # a file left by a killed `keys`: ours, reused
    with os.fdopen(fd, "w") as fh:
        json.dump({"keys": keys}, fh, indent=1)
        os.fchmod(fh.fileno(), mode)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    path = args.file or default_file()
    keys = load(path)
    if args.action == "add":
        if not args.tenant:
            print("moonbus keys add: --tenant is required", file=sys.stderr)
            return 2
        key = new_api_key()
        entry = {"hash": hash_key(key), "tenant": args.tenant, "label": args.label, "shared_cache": args.shared_cache,
                 "operator": args.operator}
        for name in ("max_concurrent", "tokens_per_minute"):
            if getattr(args, name) is not None:
                entry[name] = getattr(args, name)
        save(path, keys + [entry])
        print(key)
        print(f"(the key above is shown once; {path} keeps only its hash)", file=sys.stderr)
        return 0
    if args.action == "list":
        for e in keys:
            limits = ", ".join(f"{k} {e[k]}" for k in ("max_concurrent", "tokens_per_minute") if k in e)
            print(f"{e['hash'][:12]}  tenant {e['tenant']}  {e.get('label', '')}  {limits}"
                  f"{'  shared cache' if e.get('shared_cache') else ''}{'  operator' if e.get('operator') else ''}")
        return 0
    if not (args.tenant or args.label or args.hash):
        print("moonbus keys revoke: say which (--tenant, --label or --hash)", file=sys.stderr)
        return 2
    kept = [e for e in keys if not ((args.tenant and e["tenant"] == args.tenant) or
                                    (args.label and e.get("label") == args.label) or
                                    (args.hash and e["hash"].startswith(args.hash)))]
    save(path, kept)
    print(f"revoked {len(keys) - len(kept)} key(s)")
    return 0

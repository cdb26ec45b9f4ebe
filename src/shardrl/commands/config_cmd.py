"""`shardrl config show|validate`."""

from __future__ import annotations

import json
import sys

from ..config import ConfigError, load_config
from ..config.loader import dump_yaml


def run(args) -> int:
    if args.action == "show":
        try:
            cfg = load_config(args.file, args.overrides)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        data = cfg.model_dump(mode="json")
        print(json.dumps(data, indent=2) if args.json else dump_yaml(data))
        return 0
    failed = 0
    for path in args.files:
        try:
            load_config(path, args.overrides)
            print(f"{path}: ok")
        except ConfigError as exc:
            failed += 1
            print(exc, file=sys.stderr)
    return 1 if failed else 0

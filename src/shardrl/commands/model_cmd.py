"""`shardrl model import-gguf FILE --out DIR`."""

from __future__ import annotations

import sys


def run(args) -> int:
    from ..models.gguf_import import GGUFImportError, import_gguf

    try:
        import_gguf(args.file, args.out, dtype=args.dtype, force=args.force,
                    log=lambda line: print(line, flush=True))
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

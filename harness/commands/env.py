"""`harness env`: the fingerprint a record would carry, for this machine."""

from __future__ import annotations

import json


def add_arguments(p):
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def main(args) -> int:
    from harness.runtime import choose_device
    from harness.measure import fingerprint

    print(json.dumps(fingerprint(choose_device(args.device, 0)), indent=2))
    return 0

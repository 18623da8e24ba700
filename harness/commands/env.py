"""`harness env`: the fingerprint a record would carry, for this machine."""

from __future__ import annotations

import json

DESCRIPTION = """\
Print, as JSON, the hardware and software fingerprint that every record of this machine
carries (hosts, devices, CPU, driver and library versions)."""

EXAMPLES = """\
examples:
  harness env
  harness env --device cpu > fingerprint.json"""


def add_arguments(p):
    from harness.spec import DEVICES

    p.add_argument("--device", default="auto", choices=DEVICES)


def main(args) -> int:
    from harness.measure.fingerprint import fingerprint
    from harness.runtime import choose_device

    print(json.dumps(fingerprint(choose_device(args.device, 0)), indent=2))
    return 0

"""The machine as attn-dispatch sees it (or a described one), and each engine provider's status."""
from __future__ import annotations

import argparse
import json

from ..constraints import TABLES
from ..platform import ENGINE_PACKAGES
from .common import add_platform_argument, platform_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_platform_argument(parser)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    platform = platform_from(args)
    if args.json:
        print(json.dumps(platform.to_dict(), indent=2))
        return 0
    print(f"platform: {platform.name}")
    print(f"  device:  {platform.device_name}" + (f" (sm{platform.sm})" if platform.sm else ""))
    print(f"  torch:   {platform.torch_version}   CUDA: {platform.cuda_version or '-'}   "
          f"cuDNN: {platform.cudnn_version or '-'}")
    print(f"  torch SDPA kernels: flash={'yes' if platform.torch_flash_sdpa else 'no'} "
          f"cudnn={'yes' if platform.torch_cudnn_sdpa else 'no'}")
    print("packages:")
    for key in ENGINE_PACKAGES:
        print(f"  {key:<16}{platform.package(key).describe()}")
    print("providers (platform checks only; `explain` judges a call):")
    for table in TABLES.values():
        blocking = [c.code for c in table.checks if c.topic in ("platform", "package")]
        print(f"  {table.id:<24}{table.description}")
        if blocking:
            print(f"  {'':<24}platform/package checks: {', '.join(blocking)}")
    return 0

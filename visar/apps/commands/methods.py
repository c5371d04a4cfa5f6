"""`visar methods`: the decoding methods, whether each is lossless, and their options."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("methods", help="list decoding methods, whether each is lossless, and their options")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...accel import METHODS

    for method in METHODS.values():
        flag = "lossless" if method.lossless else "lossy"
        options = ", ".join(method.options) or "-"
        print(f"{method.name:12s} {flag:9s} {method.description}  [options: {options}]")
    return 0

"""`visar methods`: the decoding methods, whether (or when) each is lossless, the models they decode,
whether they refill a running batch (`Pipeline.generate(batch_size=)`), their options."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("methods", help="list decoding methods, whether each is lossless, and their options")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...accel import METHODS

    for method in METHODS.values():
        batch = "; a running batch refills its slots" if method.refills else ""
        where = f"{method.model_kind} models{batch}; options: {', '.join(method.options) or '-'}"
        print(f"{method.name:12s} {method.lossless_label}: {method.description}  [{where}]")
    return 0

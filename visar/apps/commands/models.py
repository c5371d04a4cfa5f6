"""`visar models`: the registered models, with -v their default sampling settings."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list registered models")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show default sampling settings")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...registry import describe_models, embedded_models, read_config

    for name, description in describe_models():
        print(f"{name:28s} {description}")
        if args.verbose and name in embedded_models():
            config = read_config(embedded_models()[name])
            print(f"{'':28s} defaults: {config.get('defaults', {})}")
    return 0

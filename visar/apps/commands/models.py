"""`visar models`: the model families visar loads and the names it knows; with -v, the folders each family
reads and each name's default sampling settings."""

from __future__ import annotations

ANY_FOLDER = (
    "Any folder or Hub repository holding a model of these families loads, listed here or not: "
    "--model FOLDER or --model OWNER/NAME."
)


def add_parser(subparsers):
    parser = subparsers.add_parser("models", help="list the model families visar loads and the names it knows")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show the folders each family reads and each name's default sampling settings",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...registry import OFFICIAL_PRESETS, describe_families, describe_models, embedded_models, read_config

    print("Families:")
    families = describe_families()
    width = max(len(title) for title, _, _ in families) + 1
    for title, description, folders in families:
        print(f"  {title:{width}s} {description}")
        if args.verbose:
            print(f"  {'':{width}s} reads {folders}")
    print(ANY_FOLDER)
    print()
    print("Names (--model NAME):")
    names = describe_models()
    width = max(len(name) for name, _ in names) + 1
    for name, description in names:
        print(f"  {name:{width}s} {description}")
        if not args.verbose:
            continue
        if name in embedded_models():
            print(f"  {'':{width}s} defaults: {read_config(embedded_models()[name]).get('defaults', {})}")
        elif name in OFFICIAL_PRESETS:
            print(f"  {'':{width}s} defaults: {OFFICIAL_PRESETS[name].defaults}")
    return 0

"""`visar methods`: the decoding methods, whether (or when) each is lossless, the models they decode,
whether they refill a running batch (`Pipeline.generate(batch_size=)`), their options; with --model,
only the methods that decode that model (`visar.accel.methods_for`)."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("methods", help="list decoding methods, whether each is lossless, and their options")
    parser.add_argument(
        "--model",
        help="list only the methods that decode this model (a registered name, Hub repository or model folder, "
        "loaded on the CPU), its kind's reference first",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    from ...accel import METHODS, methods_for

    names = list(METHODS)
    if args.model is not None:
        from ...loading import load

        names = methods_for(load(args.model, device="cpu").model)
    for method in map(METHODS.get, names):
        batch = "; a running batch refills its slots" if method.refills else ""
        where = f"{method.model_kind} models{batch}; options: {', '.join(method.options) or '-'}"
        print(f"{method.name:12s} {method.lossless_label}: {method.description}  [{where}]")
    return 0

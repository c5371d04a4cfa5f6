"""The `visar` commands, one module each.

Every command module has `add_parser(subparsers)`, which adds its subparser (with its flags,
help texts and `func`, the function that runs it), and that function, `run(args) -> int` (the
`eval` module: one per subcommand). `visar.apps.cli` assembles them; heavy modules are imported
inside the run functions, so `visar --help` stays fast.
"""

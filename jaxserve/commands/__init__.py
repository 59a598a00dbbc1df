"""``jaxserve`` subcommands that run or talk to the server (see ``jaxserve.cli``).

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and
keeps heavy imports inside ``run``.
"""

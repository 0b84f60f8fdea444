"""`gpuresa trust`: what users add to their clients once, to trust this host's sessions.

Prints the `@cert-authority` known_hosts lines, one per port, that the
sessions' SSH servers and the output service are certified by (see
`gpuresa.outputs.host_ca`), and the FTPS certificate the sessions' FTP
servers present (its PEM text, for `lftp`'s `ssl:ca-file` or
`curl --cacert`), with its SHA-256 fingerprint. Both are public; making them
(on first use) is what the daemon would do at its first session anyway.
"""

from __future__ import annotations

import argparse

from gpuresa.config.reading import load_config
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.host_ca import HostCA


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trust = subparsers.add_parser(
        "trust",
        help="the known_hosts lines and FTPS certificate users trust this host's sessions with",
    )
    trust.add_argument(
        "what",
        nargs="?",
        choices=("all", "known-hosts", "ftps-certificate"),
        default="all",
        help="known-hosts: the @cert-authority lines alone; ftps-certificate: the PEM alone",
    )
    trust.set_defaults(handler=trust_command)


def trust_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    if arguments.what == "known-hosts":
        print(HostCA(config).known_hosts_text(), end="")
        return 0
    credentials = HostCredentials(config)
    certificate = credentials.tls_files()[0].read_text(encoding="ascii")
    if arguments.what == "ftps-certificate":
        print(certificate, end="")
        return 0
    print("# Add these lines to ~/.ssh/known_hosts (one per session port and the output service),")
    print('# in place of any older line of this host whose names end in ":*":')
    print(HostCA(config).known_hosts_text(), end="")
    print()
    print("# Save this as a file and give it to FTPS clients")
    print("# (lftp: set ssl:ca-file FILE; curl: --cacert FILE); SHA-256 fingerprint")
    print(f"# {credentials.tls_fingerprint()}")
    print(certificate, end="")
    return 0
